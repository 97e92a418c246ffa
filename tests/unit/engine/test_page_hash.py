"""SGLang's chained SHA-256 page hash, pinned to golden values.

The digests below are literals that a Rust port of SGLang's radix tree pins in
its tests as produced by SGLang's ``mem_cache/utils.py::get_hash_str`` (the
native hash); ``hash_str_to_int64`` cases are those of the same tests and of
SGLang's own test of ``hash_str_to_int64`` ("aabbccdd11223344...").
"""

import pytest

from fleetserve.engine.page_hash import digest_to_int64, hash_str_to_int64, page_digests, page_hashes

H_12 = "34fb5c825de7ca4aea6e712f19d439c1da0c92c37b423936c5f618545ca4fa1f"


def hexes(tokens, ps, prior=None):
    return [d.hex() for d in page_digests(tokens, ps, bytes.fromhex(prior) if prior else None)]


def test_pages_chain_within_a_run():
    assert hexes([1, 2, 3, 4, 5], 2) == [
        H_12,
        "c57b445f90651b9a650e516ab2238c965b21af35608a31c303e6d9e407f2915c",
        "e1fd781b60f933e64fe17100c521f3130659b4761e25f7b79abcf81ae5aa23cf",
    ]


def test_one_page_covers_a_short_run():
    assert hexes([1, 2, 3], 4) == ["4636993d3e1da4e9d6b8f87b79e8f7c6d018580d52661950eabc3845c5897a4d"]


def test_parent_digest_chains_across_nodes():
    parent = hexes([1, 2, 3], 2)
    assert parent == [H_12, "3ac5d352be720e428633fe34fc74591b2b80060a7764e195d8f34068203ae98f"]
    assert hexes([7, 8], 2, parent[-1]) == ["5d13a4cf14ad5f9dbd0da79d004bd2a339f633be6100067dc3987c1880bcf0dc"]
    # chaining across a split equals hashing the whole run at once
    assert hexes([1, 2, 3, 4, 5, 6], 2) == hexes([1, 2], 2) + hexes([3, 4, 5, 6], 2, H_12)


def test_hash_str_to_int64_signed_first_16_hex_chars():
    assert hash_str_to_int64("34fb5c825de7ca4a" + "0" * 48) == 0x34FB5C825DE7CA4A
    assert hash_str_to_int64("f" * 64) == -1
    assert hash_str_to_int64("aabbccdd11223344" + "0" * 48) == 0xAABBCCDD11223344 - 2**64
    assert digest_to_int64(bytes.fromhex(H_12)) == hash_str_to_int64(H_12) == 0x34FB5C825DE7CA4A
    assert page_hashes([1, 2], 2) == [0x34FB5C825DE7CA4A]
    with pytest.raises(ValueError):
        hash_str_to_int64("abc")
    with pytest.raises(ValueError):
        hash_str_to_int64("z" * 64)


def test_empty_run_has_no_pages_and_bad_token_ids_raise():
    assert page_digests([], 4) == []
    with pytest.raises(ValueError, match="token id -1 "):
        page_digests([-1], 1)
    with pytest.raises(ValueError, match=f"token id {1 << 33} "):
        page_digests([5, 1 << 33], 2)
    with pytest.raises(ValueError, match="token id 'x' "):
        page_digests([3, "x"], 2)
