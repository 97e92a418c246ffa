"""What the radix cache tells a KV-event publisher: pages entering and leaving the tree.

:class:`~fleetserve.engine.radix_cache.RadixCache` takes ``event_sink=None``;
given one, it calls exactly the three methods below, synchronously, from the
scheduler's thread, and never for a partial page. Block ids are SGLang's
chained page hashes (:mod:`fleetserve.engine.page_hash`); with
``--page-size 1`` every token is one block, as in SGLang.

Replaying the calls in order into a set (add on ``block_stored``, discard on
``block_removed``, clear on ``all_blocks_cleared``) gives exactly the pages
in the tree. The event names follow SGLang's ``BlockStored`` /
``BlockRemoved`` / ``AllBlocksCleared`` (``sglang/srt/disaggregation/kv_events.py``).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class KVEventSink(Protocol):
    """Receiver of the radix cache's KV events (e.g. a ZMQ publisher)."""

    def block_stored(self, block_hashes: list[int], parent_block_hash: int | None,
                     token_ids: list[int], block_size: int) -> None:
        """Full pages entered the tree: one call per inserted run of consecutive pages.

        Args:
            block_hashes: int64 page hash of each page, in sequence order.
            parent_block_hash: hash of the page just before the first one; ``None``
                when the run starts at the root (the first page of a sequence).
            token_ids: the tokens of those pages, concatenated
                (``len == len(block_hashes) * block_size``).
            block_size: tokens per page (``--page-size``).
        """

    def block_removed(self, block_hashes: list[int]) -> None:
        """Pages left the tree (LRU eviction). ``block_hashes``: int64 page hashes."""

    def all_blocks_cleared(self) -> None:
        """The whole tree was emptied (flush_cache / reset); forget every page."""
