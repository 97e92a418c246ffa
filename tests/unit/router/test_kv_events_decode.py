"""KV-event decoding: golden frames laid out from vLLM's and SGLang's ``kv_events.py``."""

import msgpack
import pytest

from fleetserve.router.kv_events.decode import (AllBlocksCleared, BlockRemoved, BlockStored, MalformedFrame,
                                                decode_batch, decode_message, decode_seq, encode_seq)

# SGLang (msgspec array_like=True, tag=True): [ts, [["BlockStored", hashes, parent, tokens, block_size, lora_id]]]
SGLANG_STORED = bytes.fromhex(
    "92"                      # batch: fixarray(2) [ts, events]
    "cb3ff8000000000000"      # ts = 1.5 (float64)
    "91"                      # events: fixarray(1)
    "96"                      # event: fixarray(6)
    "ab" + b"BlockStored".hex() +
    "9107"                    # block_hashes = [7]
    "c0"                      # parent_block_hash = None
    "920102"                  # token_ids = [1, 2]
    "02"                      # block_size = 2
    "c0")                     # lora_id = None

# the same hash as uint64 2**64-1 and as int64 -1 (SGLang's Python hash() is signed)
REMOVED_U64 = bytes.fromhex("92" "00" "91" "92" "ac" + b"BlockRemoved".hex() + "91" "cf" + "ff" * 8)
REMOVED_I64 = bytes.fromhex("92" "00" "91" "92" "ac" + b"BlockRemoved".hex() + "91" "ff")


def test_sglang_array_layout_golden_bytes():
    b = decode_batch(SGLANG_STORED)
    assert b.ts == 1.5 and b.dp_rank is None
    assert b.events == [BlockStored([7], None, [1, 2], 2, False, None)]


def test_int64_and_uint64_spellings_are_one_hash():
    a, b = decode_batch(REMOVED_U64), decode_batch(REMOVED_I64)
    assert a.events == b.events == [BlockRemoved([2**64 - 1])]


def test_vllm_map_layout_with_bytes_hashes_and_unknown_fields():
    h1, h2 = b"\x01" * 32, b"\x02" * 32
    payload = msgpack.packb({
        "ts": 3.25, "data_parallel_rank": 1, "future_field": {"x": 1},
        "events": [
            {"type": "BlockStored", "block_hashes": [h1, h2], "parent_block_hash": None,
             "token_ids": [5, 6, 7, 8], "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None,
             "extra_keys": None, "group_idx": 0, "kv_cache_spec_kind": "full_attention"},
            {"type": "BlockRemoved", "block_hashes": [h2], "medium": "GPU"},
            {"type": "AllBlocksCleared"},
        ]})
    b = decode_batch(payload)
    assert (b.ts, b.dp_rank) == (3.25, 1)
    assert b.events == [BlockStored([h1, h2], None, [5, 6, 7, 8], 2, False, "GPU"),
                        BlockRemoved([h2], "GPU"), AllBlocksCleared()]


def test_vllm_array_layout_with_rank_and_trailing_fields():
    payload = msgpack.packb([0.5, [["BlockStored", [10, 11], 9, [1, 2, 3, 4], 2, None, "GPU", "my-lora", None, 3],
                                   ["BlockRemoved", [10], "GPU", 3], ["AllBlocksCleared"]], 2])
    b = decode_batch(payload)
    assert b.dp_rank == 2
    assert b.events == [BlockStored([10, 11], 9, [1, 2, 3, 4], 2, True, "GPU"), BlockRemoved([10], "GPU"),
                        AllBlocksCleared()]


def test_message_frames_and_sequence():
    seq, b = decode_message([b"", (41).to_bytes(8, "big"), SGLANG_STORED])
    assert seq == 41 and len(b.events) == 1
    assert decode_seq(encode_seq(-1)) == -1
    assert encode_seq(-1) == b"\xff" * 8


@pytest.mark.parametrize("frames", [
    [b"", b"\x00" * 8],                                   # two frames
    [b"", b"\x00" * 7, SGLANG_STORED],                    # short sequence frame
    [b"", b"\x00" * 8, b"\xc1"],                          # not msgpack (0xc1 is never used)
    [b"", b"\x00" * 8, SGLANG_STORED + b"\x00"],          # trailing bytes
    [b"", b"\x00" * 8, msgpack.packb("hello")],           # not a batch
    [b"", b"\x00" * 8, msgpack.packb([1.0])],             # no events
    [b"", b"\x00" * 8, msgpack.packb([1.0, [["Nope"]]])],  # unknown tag
    [b"", b"\x00" * 8, msgpack.packb([1.0, [["BlockStored", [1], None, [1, 2, 3], 2, None]]])],  # 3 ids, 1 block of 2
    [b"", b"\x00" * 8, msgpack.packb([1.0, [["BlockRemoved", [1.5]]]])],  # float hash
    [b"", b"\x00" * 8, msgpack.packb([1.0, [{"type": "BlockStored"}]])],  # missing fields
    [b"", b"\x00" * 8, msgpack.packb([1.0, [], -1])],      # negative rank
    [b"", b"\xff" * 8, SGLANG_STORED],                    # -1 on the live stream
])
def test_malformed_frames_raise_malformed_frame_only(frames):
    with pytest.raises(MalformedFrame):
        decode_message(frames)
