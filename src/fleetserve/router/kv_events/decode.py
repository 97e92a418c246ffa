"""Decode one KV-event ZMQ message of vLLM, SGLang or our engine.

Wire format (vLLM ``vllm/distributed/kv_events.py`` and SGLang
``python/sglang/srt/disaggregation/kv_events.py``, ``ZmqEventPublisher``):
a multipart message ``[topic, seq, payload]`` where ``seq`` is an 8-byte
big-endian integer (0, 1, 2, ... per publisher) and ``payload`` is one
msgpack ``KVEventBatch``:

* the batch is ``[ts, events]`` or ``[ts, events, data_parallel_rank]``
  (msgspec ``array_like``, SGLang) or the map
  ``{"ts", "events", "data_parallel_rank"?}`` (vLLM);
* each event is a msgspec tagged struct, either positional with the tag first,
  ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium?, lora_name?, ...]``, ``["BlockRemoved", block_hashes,
  medium?, ...]``, ``["AllBlocksCleared"]``, or the map with the tag under
  ``"type"`` (``{"type": "BlockStored", "block_hashes": ..., ...}``);
* a block hash is an integer (uint64, or int64 as SGLang's Python ``hash``
  gives) or bytes (vLLM's ``ExternalBlockHash``).  Integers are folded to
  uint64, so the int64 and uint64 spellings of one hash are one key.

Fields this module does not know are ignored.  Anything that does not fit
raises :class:`MalformedFrame`; the subscriber counts it and goes on.
Stored blocks of a LoRA adapter (``lora_id`` / ``lora_name`` set) or on a
medium other than GPU are decoded with those fields so the index can skip them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgpack

U64 = (1 << 64) - 1
END_SEQ = -1  # the replay stream's end marker, 8 bytes big-endian signed


class MalformedFrame(ValueError):
    """A message that is not a KV-event batch of a known layout."""


@dataclass(slots=True)
class BlockStored:
    """``block_hashes[i]`` holds ``token_ids[i*block_size:(i+1)*block_size]``; ``parent`` precedes block 0."""

    block_hashes: list
    parent: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora: bool = False  # stored under a LoRA adapter
    medium: str | None = None  # "GPU", "CPU", ... (vLLM); None when not given


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list
    medium: str | None = None


@dataclass(slots=True)
class AllBlocksCleared:
    pass


@dataclass(slots=True)
class EventBatch:
    ts: float
    events: list = field(default_factory=list)
    dp_rank: int | None = None  # None: the publisher did not say (SGLang before attn-dp ranks)


def block_hash(h) -> int | bytes:
    """One engine block hash as a dict key: an int folded to uint64, or bytes as they are."""
    if type(h) is int:
        return h & U64
    if isinstance(h, (bytes, bytearray, memoryview)):
        return bytes(h)
    raise MalformedFrame(f"block hash of type {type(h).__name__}")


def _hashes(v) -> list:
    if not isinstance(v, list):
        raise MalformedFrame("block_hashes is not a list")
    return [block_hash(h) for h in v]


def _int(v, what: str) -> int:
    if type(v) is not int:
        raise MalformedFrame(f"{what} is not an integer")
    return v


def _opt_str(v) -> str | None:
    return v if isinstance(v, str) else None


def _stored(f: dict) -> BlockStored:
    hashes = _hashes(f.get("block_hashes"))
    parent = f.get("parent_block_hash")
    tokens = f.get("token_ids")
    if not isinstance(tokens, list) or any(type(t) is not int for t in tokens):
        raise MalformedFrame("token_ids is not a list of integers")
    size = _int(f.get("block_size"), "block_size")
    if size <= 0 or len(tokens) != size * len(hashes):
        raise MalformedFrame(f"{len(tokens)} token ids for {len(hashes)} blocks of {size}")
    lora = f.get("lora_id") is not None or f.get("lora_name") is not None
    return BlockStored(hashes, None if parent is None else block_hash(parent), tokens, size, lora,
                       _opt_str(f.get("medium")))


# positional field names after the tag, in the peers' declaration order (extra trailing fields ignored)
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name")
_REMOVED_FIELDS = ("block_hashes", "medium")


def decode_event(ev):
    """One event (array or map form) -> :class:`BlockStored` / :class:`BlockRemoved` / :class:`AllBlocksCleared`."""
    if isinstance(ev, list):
        if not ev or not isinstance(ev[0], str):
            raise MalformedFrame("positional event without a tag")
        tag, rest = ev[0], ev[1:]
        names = _STORED_FIELDS if tag == "BlockStored" else _REMOVED_FIELDS if tag == "BlockRemoved" else ()
        f = dict(zip(names, rest))
    elif isinstance(ev, dict):
        tag, f = ev.get("type"), ev
    else:
        raise MalformedFrame(f"event of type {type(ev).__name__}")
    if tag == "BlockStored":
        return _stored(f)
    if tag == "BlockRemoved":
        return BlockRemoved(_hashes(f.get("block_hashes")), _opt_str(f.get("medium")))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise MalformedFrame(f"unknown event tag {tag!r}")


def decode_batch(payload: bytes) -> EventBatch:
    """A msgpack ``KVEventBatch`` (array or map form) -> :class:`EventBatch`; raises :class:`MalformedFrame`."""
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several types (ExtraData, FormatError, ValueError, ...)
        raise MalformedFrame(f"not msgpack: {type(e).__name__}") from None
    if isinstance(obj, list):
        if len(obj) < 2:
            raise MalformedFrame("batch array shorter than [ts, events]")
        ts, events, rank = obj[0], obj[1], (obj[2] if len(obj) > 2 else None)
    elif isinstance(obj, dict):
        ts, events, rank = obj.get("ts"), obj.get("events"), obj.get("data_parallel_rank")
    else:
        raise MalformedFrame(f"batch of type {type(obj).__name__}")
    if not isinstance(ts, (int, float)) or not isinstance(events, list):
        raise MalformedFrame("batch without a numeric ts and an events list")
    if rank is not None and (type(rank) is not int or rank < 0):
        raise MalformedFrame("data_parallel_rank is not a non-negative integer")
    return EventBatch(float(ts), [decode_event(e) for e in events], rank)


def decode_seq(raw: bytes) -> int:
    """The 8-byte big-endian sequence number (signed, so the replay end marker is -1)."""
    if len(raw) != 8:
        raise MalformedFrame(f"sequence frame of {len(raw)} bytes, not 8")
    return int.from_bytes(raw, "big", signed=True)


def decode_message(frames: list[bytes]) -> tuple[int, EventBatch]:
    """A published ``[topic, seq, payload]`` message -> ``(seq, batch)``; raises :class:`MalformedFrame`."""
    if len(frames) != 3:
        raise MalformedFrame(f"{len(frames)} frames, expected [topic, seq, payload]")
    seq = decode_seq(frames[1])
    if seq < 0:
        raise MalformedFrame("negative sequence number on the live stream")
    return seq, decode_batch(frames[2])


def encode_seq(seq: int) -> bytes:
    """``seq`` as the 8-byte big-endian frame (signed, for :data:`END_SEQ`)."""
    return seq.to_bytes(8, "big", signed=True)
