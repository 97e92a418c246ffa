"""The three KV-cache events and the msgpack payload of one batch of them.

The payload is what vLLM's ``ZmqEventPublisher`` puts in the third frame: its
``msgspec`` structs encoded with msgpack. The batch (``EventBatch``,
``array_like=True``) is always positional::

    [ts, events, data_parallel_rank]      # ts: float64 seconds since the epoch

Each event is a msgspec *tagged* struct (tag field ``"type"``, tag value the
class name). How an event looks depends on the encoding:

``map`` (vLLM since PR #42892, SGLang since #37482; our default)::

    {"type": "BlockStored", "block_hashes": [...], "parent_block_hash": h | None,
     "token_ids": [...], "block_size": n, "lora_id": None, "medium": "GPU",
     "lora_name": None, "extra_keys": [None, ...], "group_idx": 0,
     "kv_cache_spec_kind": "full_attention"}
    {"type": "BlockRemoved", "block_hashes": [...], "medium": "GPU", "group_idx": 0}
    {"type": "AllBlocksCleared"}

  Keys in that order (vLLM's field order; consumers select by name). vLLM's
  ``omit_defaults`` drops ``kv_cache_spec_sliding_window`` (``None`` for full
  attention), so do we; ``extra_keys`` holds one ``None`` per block (no
  multimodal, LoRA or salt keys), ``group_idx`` 0 (one KV-cache group).

``array`` (vLLM before #42892 with ``lora_name``, SGLang before #37482)::

    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]
    ["BlockRemoved", block_hashes, medium]
    ["AllBlocksCleared"]

  The tag first, then the fields by position. msgspec writes every field of an
  ``array_like`` struct, defaults included; SGLang's ``BlockStored`` ends at
  ``medium`` and its decoder ignores the extra trailing ``lora_name``, while
  vLLM's decoders need ``lora_name`` (it has no default), hence the eight
  elements.

``medium`` is always ``"GPU"`` (:data:`MEDIUM_GPU`), on CPU too: it names the
cache *tier*, the primary KV pool the attention kernels read, not the chip.
vLLM's block pool and SGLang's radix cache report their primary pool as
``"GPU"`` whatever the platform; ``"CPU"`` / ``"CPU_PINNED"`` mean an offload
tier that routers score apart (or ignore), which our pool is not.

The bytes equal msgspec's for the same structs (pinned in
``tests/unit/engine/test_kv_events_encoding.py``); we encode with
``msgpack`` and no msgspec.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

import msgpack

MEDIUM_GPU = "GPU"
KV_CACHE_SPEC_KIND = "full_attention"


@dataclass(frozen=True)
class BlockStored:
    """Pages ``block_hashes`` (each the parent of the next) were cached after ``parent_block_hash``."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    lora_name: str | None = None


@dataclass(frozen=True)
class BlockRemoved:
    """Pages ``block_hashes`` left the cache."""

    block_hashes: list[int]


@dataclass(frozen=True)
class AllBlocksCleared:
    """The cache was emptied."""


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


def event_to_wire(event: KVEvent, encoding: str = "map") -> Any:
    """The msgpack-ready form of ``event`` (a dict for ``map``, a list for ``array``; see the module docstring).

    Raises:
        ValueError: an unknown encoding; TypeError: not one of the three events.
    """
    if encoding not in ("map", "array"):
        raise ValueError(f"unknown KV-event encoding {encoding!r}")
    if isinstance(event, BlockStored):
        if encoding == "array":
            return ["BlockStored", list(event.block_hashes), event.parent_block_hash, list(event.token_ids),
                    event.block_size, event.lora_id, MEDIUM_GPU, event.lora_name]
        return {"type": "BlockStored", "block_hashes": list(event.block_hashes),
                "parent_block_hash": event.parent_block_hash, "token_ids": list(event.token_ids),
                "block_size": event.block_size, "lora_id": event.lora_id, "medium": MEDIUM_GPU,
                "lora_name": event.lora_name, "extra_keys": [None] * len(event.block_hashes), "group_idx": 0,
                "kv_cache_spec_kind": KV_CACHE_SPEC_KIND}
    if isinstance(event, BlockRemoved):
        if encoding == "array":
            return ["BlockRemoved", list(event.block_hashes), MEDIUM_GPU]
        return {"type": "BlockRemoved", "block_hashes": list(event.block_hashes), "medium": MEDIUM_GPU,
                "group_idx": 0}
    if isinstance(event, AllBlocksCleared):
        return ["AllBlocksCleared"] if encoding == "array" else {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV event: {type(event).__name__}")


def encode_batch(ts: float, events: list[KVEvent], data_parallel_rank: int, encoding: str = "map") -> bytes:
    """The msgpack payload ``[ts, [event, ...], data_parallel_rank]`` of one batch.

    Args:
        ts: seconds since the epoch (``time.time()``), written as float64.
        events: in the order they happened.
        data_parallel_rank: the publishing DP rank (vLLM's ``data_parallel_rank``,
            SGLang's ``attn_dp_rank``).
        encoding: ``"map"`` or ``"array"``.
    """
    return msgpack.packb([float(ts), [event_to_wire(e, encoding) for e in events], int(data_parallel_rank)])
