"""Radix cache: property tests with the KV invariant checked after every operation."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetserve.core.kv_pool import TokenSlotAllocator
from fleetserve.engine.radix_cache import RadixCache, check_kv_invariant

POOL = 24

seqs = st.lists(st.integers(0, 3), min_size=0, max_size=10)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("start"), seqs),
        st.tuples(st.just("finish"), st.integers(0, 7)),
        st.tuples(st.just("abort"), st.integers(0, 7)),
        st.tuples(st.just("evict"), st.integers(0, 12)),
        st.tuples(st.just("reset"), st.just(0)),
    ),
    max_size=40,
)


class Model:
    """Reference: prefix tuple -> slot of its last token, for every cached token."""

    def __init__(self, disable: bool):
        self.alloc = TokenSlotAllocator(POOL)
        self.cache = RadixCache(self.alloc, disable=disable)
        self.ref: dict[tuple, int] = {}
        self.running: list[dict] = []

    def check(self):
        check_kv_invariant(self.alloc, self.cache, [r["own"] for r in self.running])
        # the reference agrees with the tree's contents
        cached = set(self.cache.all_slots().tolist())
        assert cached == set(self.ref.values())
        if not self.running:
            assert self.cache.protected_size() == 0

    def expected_match(self, seq):
        m = 0
        while m < len(seq) and tuple(seq[: m + 1]) in self.ref:
            m += 1
        return [self.ref[tuple(seq[: i + 1])] for i in range(m)]

    def start(self, seq):
        slots, node = self.cache.match_prefix(seq)
        assert slots.tolist() == self.expected_match(seq)
        self.cache.inc_lock_ref(node)
        need = len(seq) - len(slots)
        if self.alloc.available_size() < need:
            self.evict(need - self.alloc.available_size())
        own = self.alloc.alloc(need)
        if own is None:
            self.cache.dec_lock_ref(node)
            return
        self.running.append({"seq": list(seq), "prefix": slots, "own": own, "node": node})

    def finish(self, i):
        if not self.running:
            return
        r = self.running.pop(i % len(self.running))
        full = torch.cat([r["prefix"], r["own"]])
        n = self.cache.insert(r["seq"], full)
        assert n >= len(r["prefix"])
        if self.cache.disable:
            assert n == 0
            self.alloc.free(full)
        else:
            self.alloc.free(full[len(r["prefix"]):n])
            for j in range(n, len(r["seq"])):
                self.ref[tuple(r["seq"][: j + 1])] = int(full[j])
            again, _ = self.cache.match_prefix(r["seq"])
            assert again.tolist() == [self.ref[tuple(r["seq"][: j + 1])] for j in range(len(r["seq"]))]
        self.cache.dec_lock_ref(r["node"])

    def abort(self, i):
        if not self.running:
            return
        r = self.running.pop(i % len(self.running))
        self.alloc.free(r["own"])
        self.cache.dec_lock_ref(r["node"])

    def evict(self, k):
        before = self.alloc.available_size()
        evictable = self.cache.evictable_size()
        freed = self.cache.evict(k)
        assert self.alloc.available_size() == before + freed
        assert freed >= min(k, evictable) if k > 0 else freed == 0
        free = set(self.alloc.free_slots().tolist())
        self.ref = {p: s for p, s in self.ref.items() if s not in free}

    def reset(self, _):
        if self.running:
            return
        self.cache.reset()
        self.ref = {}
        assert self.alloc.available_size() == POOL


@settings(max_examples=150, deadline=None)
@given(ops=ops, disable=st.booleans())
def test_radix_cache_random_ops_keep_invariant(ops, disable):
    m = Model(disable)
    m.check()
    for name, arg in ops:
        getattr(m, name)(arg)
        m.check()
    for _ in range(len(m.running)):
        m.finish(0)
        m.check()
    m.evict(POOL)
    m.check()
    if not disable:
        assert m.alloc.available_size() == POOL


def test_shared_prefix_reuse_count_and_split():
    cache = RadixCache(100)
    a = cache.allocator.alloc(6)
    assert cache.insert([1, 2, 3, 4, 5, 6], a) == 0
    slots, node = cache.match_prefix([1, 2, 3, 9])
    assert slots.tolist() == a[:3].tolist()
    assert node.key == [1, 2, 3]  # split at the match boundary
    cache.inc_lock_ref(node)
    assert cache.protected_size() == 3 and cache.evictable_size() == 3
    # eviction never touches the locked prefix
    assert cache.evict(100) == 3
    assert cache.total_size() == 3
    cache.dec_lock_ref(node)
    assert cache.evict(1) == 3 and cache.total_size() == 0
    check_kv_invariant(cache.allocator, cache)


def test_lru_evicts_least_recently_used_leaf_first():
    cache = RadixCache(100)
    for seq in ([1, 1, 1], [2, 2, 2], [3, 3, 3]):
        cache.insert(seq, cache.allocator.alloc(3))
    cache.match_prefix([1, 1, 1])  # touch: now [2,2,2] is the oldest
    cache.evict(1)
    assert cache.match_prefix([2, 2, 2])[0].numel() == 0
    assert cache.match_prefix([1, 1, 1])[0].numel() == 3
    assert cache.match_prefix([3, 3, 3])[0].numel() == 3


def test_reset_refuses_while_locked():
    cache = RadixCache(10)
    cache.insert([5, 6], cache.allocator.alloc(2))
    _, node = cache.match_prefix([5, 6])
    cache.inc_lock_ref(node)
    try:
        cache.reset()
        raised = False
    except RuntimeError:
        raised = True
    assert raised
    cache.dec_lock_ref(node)
    cache.reset()
    assert cache.allocator.available_size() == 10
