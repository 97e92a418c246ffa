"""The block index: chained keys, removals by engine hash, clears, the bound, speculation."""

from fleetserve.router.kv_events.decode import AllBlocksCleared, BlockRemoved, BlockStored
from fleetserve.router.kv_events.index import BlockIndex, block_keys

A, B = ("http://a:1", 0), ("http://b:1", 0)


def stored(hashes, parent, tokens, bs=2, **kw):
    return BlockStored(list(hashes), parent, list(tokens), bs, **kw)


def test_keys_are_chained_on_the_prefix():
    k1 = block_keys([1, 2, 3, 4], 2)
    k2 = block_keys([9, 9, 3, 4], 2)
    assert len(k1) == 2 and k1[1] != k2[1]  # same second block, other prefix
    assert block_keys([1, 2, 3], 2) == k1[:1]  # the partial block has no key
    assert block_keys([1, 2, 3, 4], 2) == k1  # deterministic


def test_match_follows_stored_blocks_and_parents():
    ix = BlockIndex()
    ix.apply(A, stored([100], None, [1, 2]))
    ix.apply(A, stored([101, 102], 100, [3, 4, 5, 6]))  # continues block 100
    ix.apply(B, stored([7], None, [1, 2]))
    m = ix.match([1, 2, 3, 4, 5, 6, 7], [A, B])
    assert m == {A: 6, B: 2}
    assert ix.match([1, 2, 3, 9], [A, B]) == {A: 2, B: 2}
    assert ix.match([2, 1], [A, B]) == {A: 0, B: 0}


def test_orphan_and_skipped_blocks_are_not_indexed():
    ix = BlockIndex()
    ix.apply(A, stored([5], 999, [1, 2]))  # unknown parent
    ix.apply(A, stored([6], None, [1, 2], lora=True))
    ix.apply(A, stored([7], None, [1, 2], medium="CPU"))
    assert ix.orphans == 1 and ix.skipped == 2 and len(ix) == 0
    assert ix.match([1, 2], [A]) == {A: 0}


def test_removal_by_engine_hash_cuts_the_run():
    ix = BlockIndex()
    ix.apply(A, stored([1, 2, 3], None, [1, 2, 3, 4, 5, 6]))
    ix.apply(A, BlockRemoved([2]))
    assert ix.match([1, 2, 3, 4, 5, 6], [A]) == {A: 2}  # block 3 is still there but its prefix is not
    ix.apply(A, BlockRemoved([12345]))  # unknown: ignored
    assert ix.blocks_of(A) == 2


def test_all_blocks_cleared_drops_only_that_target():
    ix = BlockIndex()
    ix.apply(A, stored([1], None, [1, 2]))
    ix.apply(B, stored([1], None, [1, 2]))
    ix.apply(A, AllBlocksCleared())
    assert ix.match([1, 2], [A, B]) == {A: 0, B: 2}
    assert len(ix) == 1


def test_bound_is_enforced_lru_first():
    ix = BlockIndex(max_blocks=3)
    ix.apply(A, stored([1, 2], None, [1, 2, 3, 4]))
    ix.apply(B, stored([1, 2], None, [1, 2, 3, 4]))
    assert len(ix) == 3 and ix.evicted == 1
    assert ix.match([1, 2, 3, 4], [A, B]) == {A: 0, B: 4}  # A's first block went first
    for i in range(100):
        ix.apply(A, stored([1000 + i], None, [i, i]))
        assert len(ix) <= 3


def test_speculative_entries_count_until_they_expire():
    ix = BlockIndex()
    ix.apply(A, stored([1], None, [0, 0]))  # learns A's block size
    assert ix.add_speculative(A, [5, 6, 7, 8, 9], ttl=2.0, now=100.0) == 2
    assert ix.add_speculative(B, [5, 6], ttl=2.0, now=100.0) == 0  # B's block size unknown
    assert ix.match([5, 6, 7, 8], [A], now=101.0) == {A: 4}
    assert ix.match([5, 6, 7, 8], [A], now=102.5) == {A: 0}


def test_owner_records_leave_the_cyclic_gc():
    """Each block's owners are a tuple of targets, which the cyclic GC stops tracking (a set stays tracked:
    with 2^20 blocks a full collection walked them all, ~90 ms with every thread stopped); shared and
    dropped owners still come out right."""
    import gc

    ix = BlockIndex()
    a, b = ("http://a:1", 0), ("http://b:1", 0)
    ix.apply(a, BlockStored([1, 2], None, [1, 2, 3, 4], 2))
    ix.apply(b, BlockStored([7], None, [1, 2], 2))
    gc.collect()
    gc.collect()
    assert all(type(v) is tuple and not gc.is_tracked(v) for v in ix._owners.values())
    assert ix.match([1, 2, 3, 4, 5], [a, b]) == {a: 4, b: 2}
    ix.drop_target(a)
    assert ix.match([1, 2, 3, 4, 5], [a, b]) == {a: 0, b: 2} and len(ix._owners) == 1
