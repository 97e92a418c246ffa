"""held.union_of_prefixes: the tokens an engine holds for the cached prefixes of running requests,
each shared page once (the trie's node count), against a brute-force count of distinct prefixes."""

from hypothesis import example, given, settings, strategies as st

from fleetserve.router.kv_events.held import HeldPrefixes, union_of_prefixes
from fleetserve.router.kv_events.policy import RouteKey

SYS = list(range(500, 2500))  # a 2,000-token system prompt


def key(tokens, cached):
    k = RouteKey("", tokens, 8)
    k.cached = cached
    return k


def brute(keys, page=1):
    """Distinct (page-aligned when shared) prefixes: count the distinct prefixes s[:n] for n <= c."""
    if page == 1:
        return len({tuple(k.tokens[:n]) for k in keys if k.tokens for n in range(1, k.cached + 1)}) + sum(
            k.cached for k in keys if not k.tokens)
    raise AssertionError


def test_conversations_on_one_system_prompt_hold_it_once():
    keys = [key(SYS + [10_000 + i] * 300 + [7], 2000 + 300) for i in range(16)]
    assert union_of_prefixes(keys) == 2000 + 16 * 300
    assert sum(k.cached for k in keys) == 16 * 2300  # what was taken off before: 34,500 too many


def test_a_truncated_prefix_inside_another_counts_nothing_more():
    a = key(SYS + [1, 2, 3], 2003)
    b = key(SYS + [9, 9], 1000)  # its cached part is inside a's
    c = key(SYS[:1500] + [4], 1501)
    assert union_of_prefixes([a, b, c]) == 2003 + 1
    assert union_of_prefixes([b]) == 1000


def test_shared_parts_count_in_whole_pages():
    a = key(SYS[:30] + [1] * 20, 48)
    b = key(SYS[:30] + [2] * 20, 48)  # they share 30 tokens: 28 in whole pages of 4
    assert union_of_prefixes([a, b], page=4) == 96 - 28
    assert union_of_prefixes([a, b], page=1) == 96 - 30


def test_keys_without_ids_never_share():
    t1, t2 = RouteKey("hello " * 100, None, 8), RouteKey("hello " * 100, None, 8)
    t1.cached = t2.cached = 120
    assert union_of_prefixes([t1, t2, key(SYS, 100)]) == 340


def test_held_prefixes_moves_keys_from_waiting_to_running():
    h = HeldPrefixes()
    ks = [key(SYS + [i], 2000) for i in range(3)]
    for k in ks:
        k.queued = 1
        k.charged = (None, 0, 0.0)
        h.add(k)
    assert h.counted(1.0) == 6000 and h.counted(None) == 0
    for k in ks:
        h.prefilled(k)
    assert h.counted(1.0) == 2000
    assert h.remove(ks[0]) == 0  # the other two still hold the system prompt
    assert h.remove(ks[1]) == 0
    assert h.remove(ks[2]) == 2000
    assert not h and h.counted(1.0) == 0


ids = st.lists(st.integers(0, 3), min_size=1, max_size=12)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(ids, st.integers(0, 12)), min_size=1, max_size=8))
def test_union_equals_the_distinct_prefixes(items):
    keys = [key(t, min(c, len(t))) for t, c in items]
    keys = [k for k in keys if k.cached > 0]
    assert union_of_prefixes(keys) == brute(keys)


ops = st.lists(st.tuples(st.sampled_from(["add_waiting", "add_running", "prefilled", "remove"]),
                         st.integers(0, 7), ids, st.integers(1, 12)), min_size=1, max_size=40)


def apply(h: HeldPrefixes, keys: dict, op: str, slot: int, toks: list, c: int, page: int) -> None:
    """One step of the property tests below on ``h``: add a waiting or running key (``keys``: slot ->
    key), end a prefill, or remove a key ("remove": freed tokens asked for; "drop": freed=False), with
    what remove answers checked against a recount.  Other ops, and ops on an empty slot, do nothing."""
    k = keys.get(slot)
    if op.startswith("add"):
        if k is not None:
            return
        k = keys[slot] = key([1, 2] + toks, min(c, len(toks) + 2))  # a common opening to share
        k.queued = 1 if op == "add_waiting" else 0
        k.charged = (None, 0, 0.0)
        h.add(k)
    elif k is None:
        return
    elif op == "prefilled":
        h.prefilled(k)
    elif op in ("remove", "drop"):
        running = k in h.running
        before = union_of_prefixes(list(h.running), page)
        freed = h.remove(k, op == "remove")
        del keys[slot]
        if op == "remove":  # the engine frees the union before less the union after
            assert freed == (before - union_of_prefixes(list(h.running), page) if running else k.cached)
        else:
            assert freed == (0 if running else k.cached)


@settings(max_examples=300, deadline=None)
@given(ops, st.sampled_from([1, 2, 4]))
def test_the_kept_union_equals_a_recount_after_every_change(steps, page):
    """HeldPrefixes keeps the running union up to date key by key: after any sequence of adds, ended
    prefills and removals it equals union_of_prefixes over the running keys, and what remove says the
    engine frees is the union before less the union after."""
    h = HeldPrefixes(page)
    keys: dict = {}
    for op, slot, toks, c in steps:
        apply(h, keys, op, slot, toks, c, page)
        assert h.running_union() == union_of_prefixes(list(h.running), page)
        assert h.waiting_tokens == sum(w.cached for w in h.waiting)


lazy_ops = st.lists(st.tuples(st.sampled_from(["add_waiting", "add_running", "prefilled", "remove", "drop", "ask"]),
                              st.integers(0, 7), ids, st.integers(1, 12)), min_size=1, max_size=40)


@settings(max_examples=300, deadline=None)
@given(lazy_ops, st.sampled_from([1, 2, 4]))
@example([("add_running", 0, [5, 6], 3), ("add_running", 1, [5, 7], 3), ("drop", 0, [], 1)], 1)  # dropped unsorted
def test_the_union_built_late_equals_the_one_kept_from_the_start(steps, page):
    """The sorted order is built only when first asked for ("ask", or a removal whose freed tokens are
    needed: "remove"); removals that need no answer ("drop": freed=False) before then only forget the
    key.  Whenever it is asked, and at the end, the union equals a recount over the running keys."""
    h = HeldPrefixes(page)
    keys: dict = {}
    for op, slot, toks, c in steps:
        if op == "ask":
            assert h.running_union() == union_of_prefixes(list(h.running), page)
        else:
            apply(h, keys, op, slot, toks, c, page)
    assert h.running_union() == union_of_prefixes(list(h.running), page)
    assert h.waiting_tokens == sum(w.cached for w in h.waiting)


def test_ids_beyond_one_character_and_keys_without_ids_are_kept_apart():
    big = [0x110000 + i for i in range(4)]  # no one-character text: compared as lists
    a, b = key(big + [1, 2], 6), key(big + [3], 5)
    t = RouteKey("hello " * 50, None, 8)
    t.cached = 30
    h = HeldPrefixes()
    for k in (a, b, t, key(SYS, 100)):
        k.queued = 0
        h.add(k)
    assert h.running_union() == 6 + 1 + 30 + 100 == union_of_prefixes([a, b, t, key(SYS, 100)])
    assert h.remove(t) == 30 and h.remove(a) == 2 and h.remove(b) == 5
    assert h.running_union() == 100


def test_pinned_counts_waiting_and_running_prefixes_as_one_union():
    """The pool term's figure: 3 waiting and 2 running requests on one system prompt hold it once, plus
    each one's own part; the engine-facing count (``counted``) still takes waiting ones whole."""
    h = HeldPrefixes()
    ks = [key(SYS + [20_000 + i] * 100 + [7], 2100) for i in range(5)]
    for i, k in enumerate(ks):
        k.queued = 1 if i < 3 else 0
        k.charged = (None, 0, 0.0)
        h.add(k)
    assert h.pinned() == 2000 + 5 * 100
    assert h.counted(1.0) == 3 * 2100 + (2000 + 2 * 100)
    for k in ks[:3]:
        h.prefilled(k)  # none waiting now: the running union alone
    assert h.pinned() == h.running_union() == 2000 + 5 * 100
    assert HeldPrefixes().pinned() == 0
