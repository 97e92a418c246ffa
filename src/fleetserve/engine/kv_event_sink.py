"""The interface through which the radix cache reports KV-cache events.

``RadixCache(..., event_sink=None)`` calls these three methods when pages
enter or leave the tree; :class:`fleetserve.engine.kv_events.publisher.KVEventPublisher`
implements it and publishes the events over ZMQ the way vLLM and SGLang do.
"""

from __future__ import annotations

from typing import Protocol


class KVEventSink(Protocol):
    """Receiver of KV-cache events (all hashes are Python ints)."""

    def block_stored(self, block_hashes: list[int], parent_block_hash: int | None, token_ids: list[int],
                     block_size: int) -> None:
        """Pages ``block_hashes`` (a chain, each the parent of the next) were added after ``parent_block_hash``
        (``None``: they start at the root); ``token_ids`` are their tokens, ``block_size`` tokens a page."""

    def block_removed(self, block_hashes: list[int]) -> None:
        """Pages ``block_hashes`` were evicted."""

    def all_blocks_cleared(self) -> None:
        """The whole cache was emptied."""
