"""Radix cache: property tests with the KV invariant checked after every operation,
for page sizes 1, 4 and 16; a recording KV-event sink mirrors the tree's pages."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetserve.core.kv_pool import TokenSlotAllocator
from fleetserve.engine.kv_event_sink import KVEventSink
from fleetserve.engine.page_hash import page_hashes
from fleetserve.engine.radix_cache import RadixCache, check_kv_invariant

PAGE_SIZES = (1, 4, 16)


def pool_for(ps):
    return 24 if ps == 1 else 6 * ps


def ops_for(ps):
    seqs = st.lists(st.integers(0, 3 if ps == 1 else 1), min_size=0, max_size=10 if ps == 1 else 3 * ps)
    return st.lists(
        st.one_of(
            st.tuples(st.just("start"), seqs),
            st.tuples(st.just("finish"), st.integers(0, 7)),
            st.tuples(st.just("abort"), st.integers(0, 7)),
            st.tuples(st.just("evict"), st.integers(0, 2 * pool_for(ps) // 4)),
            st.tuples(st.just("reset"), st.just(0)),
        ),
        max_size=40,
    )


class RecordingSink:
    """A KVEventSink that replays its events into ``mirror``: page hash -> (parent hash, page tokens)."""

    def __init__(self):
        self.mirror: dict[int, tuple[int | None, tuple[int, ...]]] = {}
        self.calls: list[tuple] = []

    def block_stored(self, block_hashes, parent_block_hash, token_ids, block_size):
        self.calls.append(("stored", list(block_hashes), parent_block_hash, list(token_ids), block_size))
        assert len(token_ids) == len(block_hashes) * block_size  # never a partial page
        parent = parent_block_hash
        for i, h in enumerate(block_hashes):
            assert h not in self.mirror, "page stored twice"
            self.mirror[h] = (parent, tuple(token_ids[i * block_size: (i + 1) * block_size]))
            parent = h

    def block_removed(self, block_hashes):
        self.calls.append(("removed", list(block_hashes)))
        for h in block_hashes:
            del self.mirror[h]

    def all_blocks_cleared(self):
        self.calls.append(("cleared",))
        self.mirror.clear()


def tree_pages(cache):
    """page hash -> (parent page hash, page tokens) of every page in the tree, recomputed from the root."""
    ps = cache.page_size
    out = {}
    stack = [(child, []) for child in cache.root.children.values()]
    while stack:
        node, above = stack.pop()
        path = above + node.key
        hashes = page_hashes(path, ps)
        first = len(above) // ps
        assert [int.from_bytes(d[:8], "big", signed=True) for d in node.hashes] == hashes[first:]
        for i in range(first, len(hashes)):
            out[hashes[i]] = (hashes[i - 1] if i else None, tuple(path[i * ps: (i + 1) * ps]))
        stack.extend((c, path) for c in node.children.values())
    return out


class Model:
    """Reference: (tokens up to the end of token j's page, j) -> slot of token j, for every cached token."""

    def __init__(self, disable: bool, ps: int = 1):
        self.ps = ps
        self.pool = pool_for(ps)
        self.alloc = TokenSlotAllocator(self.pool, ps)
        self.sink = RecordingSink()
        self.cache = RadixCache(self.alloc, disable=disable, event_sink=self.sink)
        self.ref: dict[tuple, int] = {}
        self.running: list[dict] = []

    def check(self):
        check_kv_invariant(self.alloc, self.cache, [r["own"] for r in self.running])
        # the reference agrees with the tree's contents
        cached = set(self.cache.all_slots().tolist())
        assert cached == set(self.ref.values())
        if not self.running:
            assert self.cache.protected_size() == 0
        # replaying the KV events gives exactly the tree's pages (hashes chained from the root)
        assert self.sink.mirror == tree_pages(self.cache)
        assert len(self.sink.mirror) == self.cache.total_size() // self.ps

    def key(self, seq, j):
        return tuple(seq[: j - j % self.ps + self.ps]), j

    def expected_match(self, seq):
        m = 0
        while m + self.ps <= len(seq) and self.key(seq, m) in self.ref:
            m += self.ps  # whole pages only
        return [self.ref[self.key(seq, i)] for i in range(m)]

    def start(self, seq):
        slots, node = self.cache.match_prefix(seq)
        assert slots.tolist() == self.expected_match(seq)
        self.cache.inc_lock_ref(node)
        need = len(seq) - len(slots)
        whole = -(-need // self.ps) * self.ps
        if self.alloc.available_size() < whole:
            self.evict(whole - self.alloc.available_size())
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
            whole = len(r["seq"]) - len(r["seq"]) % self.ps
            assert n % self.ps == 0 and n <= whole
            self.alloc.free(full[len(r["prefix"]):n])
            if whole < len(r["seq"]):
                self.alloc.free(full[whole:])  # the partial last page stays out of the tree
            for j in range(n, whole):
                assert self.key(r["seq"], j) not in self.ref
                self.ref[self.key(r["seq"], j)] = int(full[j])
            again, _ = self.cache.match_prefix(r["seq"])
            assert again.tolist() == [self.ref[self.key(r["seq"], j)] for j in range(whole)]
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
        assert self.alloc.available_size() == self.pool


def _random_ops(ps, data):
    disable = data.draw(st.booleans())
    m = Model(disable, ps)
    m.check()
    for name, arg in data.draw(ops_for(ps)):
        getattr(m, name)(arg)
        m.check()
    for _ in range(len(m.running)):
        m.finish(0)
        m.check()
    m.evict(m.pool)
    m.check()
    if not disable:
        assert m.alloc.available_size() == m.pool


@pytest.mark.parametrize("ps", PAGE_SIZES)
@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_radix_cache_random_ops_keep_invariant(ps, data):
    _random_ops(ps, data)


def test_recording_sink_is_a_kv_event_sink():
    assert isinstance(RecordingSink(), KVEventSink)


def test_no_sink_hashes_nothing():
    cache = RadixCache(64, page_size=4)
    cache.insert(list(range(10)), cache.allocator.alloc(10)[:10])
    assert all(n.hashes is None for n in cache._nodes())


@pytest.mark.parametrize("ps,cached,expect", [(1, 10, 10), (4, 10, 8), (16, 10, 0), (4, 12, 12), (4, 3, 0)])
def test_prefix_match_rounds_down_to_whole_pages(ps, cached, expect):
    cache = RadixCache(64, page_size=ps)
    seq = list(range(100, 100 + cached))
    slots = cache.allocator.alloc(cached)
    n = cache.insert(seq, slots)
    assert n == 0 and cache.total_size() == cached - cached % ps
    got, node = cache.match_prefix(seq + [7, 7, 7, 7])
    assert got.tolist() == slots[:expect].tolist()
    assert len(node.key) == expect or node is cache.root
    # a query shorter than the cached run also matches only whole pages of it
    got, _ = cache.match_prefix(seq[: cached - 1])
    assert int(got.numel()) == min(expect, (cached - 1) - (cached - 1) % ps)


def test_paged_split_only_at_page_boundaries_and_hashes_follow():
    sink = RecordingSink()
    cache = RadixCache(64, page_size=4, event_sink=sink)
    a = list(range(1, 13))  # 3 pages
    cache.insert(a, cache.allocator.alloc(12))
    b = a[:6] + [99, 98, 97, 96, 95, 94]  # diverges inside page 2
    sb = cache.allocator.alloc(12)
    n = cache.insert(b, sb)
    assert n == 4  # only page 1 is shared
    cache.allocator.free(sb[:4])  # b's copy of the shared page
    keys = sorted(len(c.key) for c in cache._nodes() if c is not cache.root)
    assert keys == [4, 8, 8]
    # the second insert stored pages 2-3 of b under page 1 of a
    kind, hashes, parent, toks, size = sink.calls[-1]
    assert kind == "stored" and size == 4 and toks == b[4:12]
    assert parent == page_hashes(a, 4)[0] and hashes == page_hashes(b, 4)[1:]
    check_kv_invariant(cache.allocator, cache, [])
    assert sink.mirror == tree_pages(cache)
    cache.evict(100)
    assert sink.mirror == {} and cache.total_size() == 0
    cache.insert(a, cache.allocator.alloc(12))
    cache.reset()
    assert sink.calls[-1] == ("cleared",) and sink.mirror == {}


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


def test_pages_differing_in_their_last_token_are_siblings():
    cache = RadixCache(32, page_size=4)
    a, b = cache.allocator.alloc(4), cache.allocator.alloc(4)
    assert cache.insert([1, 0, 0, 0], a) == 0 and cache.insert([1, 0, 0, 1], b) == 0
    assert len(cache.root.children) == 2
    assert cache.match_prefix([1, 0, 0, 1, 5])[0].tolist() == b.tolist()
    assert cache.match_prefix([1, 0, 0, 0])[0].tolist() == a.tolist()
    assert cache.match_prefix([1, 0, 0, 2])[0].numel() == 0
    check_kv_invariant(cache.allocator, cache)
