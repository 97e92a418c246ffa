"""KV-event payloads: the bytes vLLM's msgspec structs produce, and the layouts vLLM's and SGLang's consumers read.

Golden bytes were produced once with msgspec 0.23 from struct definitions written
from the peers' sources (vllm/distributed/kv_events.py: ``EventBatch`` array_like,
``KVCacheEvent`` tagged, map-encoded since vLLM PR #42892, array-encoded before;
sglang/srt/disaggregation/kv_events.py: the same positional batch, ``attn_dp_rank``
third).
"""

import msgpack
import pytest

from fleetserve.engine.kv_events.events import (
    MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, encode_batch, event_to_wire,
)

U64_MAX = 2**64 - 1
SAMPLE_MAP = [BlockStored([1, U64_MAX], None, [5, 6], 1), BlockRemoved([7]), AllBlocksCleared()]
SAMPLE_ARRAY = [BlockStored([1, U64_MAX], 3, [5, 6], 1), BlockRemoved([7]), AllBlocksCleared()]

# msgspec.msgpack.Encoder().encode(EventBatch(1.5, [BlockStored(..., extra_keys=[None, None], group_idx=0,
#   kv_cache_spec_kind="full_attention"), BlockRemoved([7], "GPU", group_idx=0), AllBlocksCleared()], 1))
GOLDEN_MAP = bytes.fromhex(
    "93cb3ff8000000000000938ba474797065ab426c6f636b53746f726564ac626c6f636b5f6861736865739201cfffffffffffffffff"
    "b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473920506aa626c6f636b5f73697a6501a76c6f72615f6964c0"
    "a66d656469756da3475055a96c6f72615f6e616d65c0aa65787472615f6b65797392c0c0a967726f75705f69647800b26b765f6361"
    "6368655f737065635f6b696e64ae66756c6c5f617474656e74696f6e84a474797065ac426c6f636b52656d6f766564ac626c6f636b"
    "5f6861736865739107a66d656469756da3475055a967726f75705f6964780081a474797065b0416c6c426c6f636b73436c65617265"
    "6401")
# the same with array_like event structs carrying vLLM's fields up to lora_name, DP rank 0
GOLDEN_ARRAY = bytes.fromhex(
    "93cb3ff80000000000009398ab426c6f636b53746f7265649201cfffffffffffffffff0392050601c0a3475055c093ac426c6f636b"
    "52656d6f7665649107a347505591b0416c6c426c6f636b73436c656172656400")

# Field layouts, from the peers' struct definitions (tag first in the array form).
VLLM_BLOCK_STORED = ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                     "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"]
VLLM_BLOCK_STORED_REQUIRED = VLLM_BLOCK_STORED[:7]  # no default: msgspec refuses a map without them
VLLM_BLOCK_REMOVED = ["block_hashes", "medium", "group_idx"]
SGLANG_BLOCK_STORED = ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"]
SGLANG_BLOCK_REMOVED = ["block_hashes", "medium"]


def test_map_payload_equals_vllm_bytes():
    assert encode_batch(1.5, SAMPLE_MAP, 1, "map") == GOLDEN_MAP


def test_array_payload_equals_older_vllm_bytes():
    assert encode_batch(1.5, SAMPLE_ARRAY, 0, "array") == GOLDEN_ARRAY


def test_batch_is_positional_ts_events_rank():
    ts, events, rank = msgpack.unpackb(encode_batch(1234.25, SAMPLE_MAP, 3))
    assert isinstance(ts, float) and ts == 1234.25 and rank == 3 and len(events) == 3


def test_map_events_as_vllm_and_sglang_consumers_read_them():
    stored, removed, cleared = msgpack.unpackb(encode_batch(0.0, SAMPLE_MAP, 0, "map"))[1]
    assert list(stored) == ["type"] + VLLM_BLOCK_STORED[:-1]  # the sliding window is None: omitted (omit_defaults)
    assert stored["type"] == "BlockStored"
    assert set(VLLM_BLOCK_STORED_REQUIRED) <= set(stored) and set(SGLANG_BLOCK_STORED) <= set(stored)
    assert {k: stored[k] for k in VLLM_BLOCK_STORED[:-1]} == {
        "block_hashes": [1, U64_MAX], "parent_block_hash": None, "token_ids": [5, 6], "block_size": 1,
        "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": [None, None], "group_idx": 0,
        "kv_cache_spec_kind": "full_attention"}
    assert list(removed) == ["type"] + VLLM_BLOCK_REMOVED and set(SGLANG_BLOCK_REMOVED) <= set(removed)
    assert removed == {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU", "group_idx": 0}
    assert cleared == {"type": "AllBlocksCleared"}


def test_array_events_by_position():
    stored, removed, cleared = msgpack.unpackb(encode_batch(0.0, SAMPLE_ARRAY, 0, "array"))[1]
    assert stored == ["BlockStored", [1, U64_MAX], 3, [5, 6], 1, None, "GPU", None]
    # SGLang's BlockStored is the first 6 fields; its msgspec decoder ignores the trailing lora_name
    assert dict(zip(SGLANG_BLOCK_STORED, stored[1:])) == {
        "block_hashes": [1, U64_MAX], "parent_block_hash": 3, "token_ids": [5, 6], "block_size": 1,
        "lora_id": None, "medium": "GPU"}
    assert dict(zip(VLLM_BLOCK_STORED_REQUIRED, stored[1:])) == {
        "block_hashes": [1, U64_MAX], "parent_block_hash": 3, "token_ids": [5, 6], "block_size": 1,
        "lora_id": None, "medium": "GPU", "lora_name": None}
    assert removed == ["BlockRemoved", [7], "GPU"] and cleared == ["AllBlocksCleared"]


def test_medium_is_the_primary_tier_and_lora_fields_pass_through():
    assert MEDIUM_GPU == "GPU"  # vLLM MEDIUM_GPU, SGLang StorageMedium.GPU
    ev = BlockStored([9], 8, [1], 1, lora_id=4, lora_name="ad")
    assert event_to_wire(ev, "array")[5:] == [4, "GPU", "ad"]
    m = event_to_wire(ev, "map")
    assert (m["lora_id"], m["medium"], m["lora_name"]) == (4, "GPU", "ad")


def test_unknown_encoding_or_event_raise():
    with pytest.raises(ValueError):
        event_to_wire(AllBlocksCleared(), "json")
    with pytest.raises(TypeError):
        event_to_wire(object(), "map")
