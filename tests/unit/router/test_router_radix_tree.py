"""The router's radix tree against a naive reference, under random operation sequences.

The reference keeps, per tenant, a dict of every prefix it holds -> the clock of
the last insert that covered it.  Matching, per-tenant content, sizes and
character-exact LRU eviction must agree with it after every operation.
"""

from hypothesis import given, settings, strategies as st

from fleetserve.router.radix_tree import RadixTree


class NaiveTree:
    def __init__(self) -> None:
        self.held: dict[str, dict[str, int]] = {}
        self.clock = 0

    def insert(self, text: str, tenant: str) -> None:
        if not text:
            return
        self.clock += 1
        d = self.held.setdefault(tenant, {})
        for i in range(1, len(text) + 1):
            d[text[:i]] = self.clock

    def match(self, text: str) -> tuple[int, set[str]]:
        best, owners = 0, set()
        for tenant, d in self.held.items():
            n = 0
            while n < len(text) and text[: n + 1] in d:
                n += 1
            if n > best:
                best, owners = n, {tenant}
            elif n == best and n > 0:
                owners.add(tenant)
        return best, owners

    def match_tenant(self, text: str, tenant: str) -> int:
        d = self.held.get(tenant, {})
        n = 0
        while n < len(text) and text[: n + 1] in d:
            n += 1
        return n

    def total(self) -> int:
        return sum(len(d) for d in self.held.values())

    def evict(self, budget: int) -> None:
        while self.total() > budget:
            leaves = []
            for tenant, d in self.held.items():
                for p, stamp in d.items():
                    if not any(q != p and len(q) == len(p) + 1 and q.startswith(p) for q in d):
                        leaves.append((stamp, -len(p), tenant, p))
            # oldest first; within one tenant's leaf run, the deepest character goes first
            _, _, tenant, p = min(leaves)
            del self.held[tenant][p]

    def remove(self, tenant: str) -> None:
        self.held.pop(tenant, None)


# Text over a small alphabet (so prefixes collide) mixing ASCII, CJK and emoji code points.
ALPHABET = st.sampled_from(list("ab") + ["中", "文", "😀", "👍"])
TEXT = st.lists(ALPHABET, min_size=0, max_size=9).map("".join)
TENANTS = ("w0", "w1", "w2")
TENANT = st.sampled_from(TENANTS)
OP = st.one_of(
    st.tuples(st.just("insert"), TEXT, TENANT),
    st.tuples(st.just("match"), TEXT, TENANT),
    st.tuples(st.just("evict"), st.integers(0, 30), TENANT),
    st.tuples(st.just("remove"), TEXT, TENANT),
)


def check_same(tree: RadixTree, ref: NaiveTree) -> None:
    assert tree.recount() == tree.tenant_sizes()
    assert tree.total_size == ref.total() == sum(tree.tenant_sizes().values())
    for tenant in {"w0", "w1", "w2"}:
        want = ref.held.get(tenant, {})
        got = tree.tenant_prefixes(tenant)
        assert set(got) == set(want)
        assert tree.tenant_size(tenant) == len(want)


@settings(max_examples=200, deadline=None)
@given(st.lists(OP, max_size=40))
def test_tree_matches_naive_reference(ops):
    tree, ref = RadixTree(), NaiveTree()
    for kind, arg, tenant in ops:
        if kind == "insert":
            tree.insert(arg, tenant)
            ref.insert(arg, tenant)
        elif kind == "match":
            matched, owners = tree.match(arg)
            want_n, want_owners = ref.match(arg)
            assert matched == want_n
            assert set(owners) == want_owners
            assert tree.prefix_match_tenant(arg, tenant) == ref.match_tenant(arg, tenant)
            per = tree.match_per_tenant(arg)
            for t in TENANTS:
                assert per.get(t, 0) == ref.match_tenant(arg, t)
            assert all(v > 0 for v in per.values())
            n, best = tree.prefix_match(arg)
            assert n == want_n and (best in want_owners if want_owners else best is None)
        elif kind == "evict":
            before = tree.total_size
            dropped = tree.evict(arg)
            ref.evict(arg)
            assert tree.total_size == min(before, arg)
            assert dropped == before - tree.total_size
        else:
            tree.remove_tenant(tenant)
            ref.remove(tenant)
        check_same(tree, ref)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(TEXT, TENANT), max_size=20), TEXT, TENANT)
def test_prefix_match_tenant_is_per_tenant_longest_prefix(inserts, query, tenant):
    tree = RadixTree()
    held = set()
    for text, t in inserts:
        tree.insert(text, t)
        if t == tenant:
            held.update(text[:i] for i in range(1, len(text) + 1))
    want = 0
    while want < len(query) and query[: want + 1] in held:
        want += 1
    assert tree.prefix_match_tenant(query, tenant) == want


def test_cjk_and_emoji_are_matched_per_code_point():
    tree = RadixTree()
    tree.insert("你好世界😀😀", "a")
    tree.insert("你好世人", "b")
    assert tree.match("你好世界😀👍")[0] == 5
    assert set(tree.match("你好世界😀👍")[1]) == {"a"}
    assert tree.match("你好世")[0] == 3
    assert set(tree.match("你好世")[1]) == {"a", "b"}
    assert tree.tenant_size("a") == 6 and tree.tenant_size("b") == 4


def test_empty_text_is_not_inserted_and_matches_nothing():
    tree = RadixTree()
    tree.insert("", "a")
    assert tree.total_size == 0
    assert tree.match("") == (0, {})
    tree.insert("abc", "a")
    assert tree.match("") == (0, {})
    assert tree.prefix_match("zzz") == (0, None)


def test_evict_drops_least_recently_used_first_and_exactly_to_budget():
    tree = RadixTree()
    tree.insert("old-prompt", "a")   # 10 chars, clock 1
    tree.insert("new-prompt", "b")   # 10 chars, clock 2
    tree.insert("old-prompt", "a")   # touch again: now a is the newest
    assert tree.evict(15) == 5
    assert tree.total_size == 15
    assert tree.tenant_size("a") == 10 and tree.tenant_size("b") == 5
    assert tree.prefix_match_tenant("new-prompt", "b") == 5
    assert tree.evict(0) == 15 and tree.total_size == 0 and tree.recount() == {"a": 0, "b": 0}


def test_remove_tenant_keeps_the_others():
    tree = RadixTree()
    tree.insert("shared prefix one", "a")
    tree.insert("shared prefix two", "b")
    tree.remove_tenant("a")
    assert tree.tenant_size("a") == 0
    assert tree.match("shared prefix one") == (14, {"b": tree.match("shared prefix one")[1]["b"]})
    assert tree.total_size == len("shared prefix two")


def test_an_insert_after_a_match_of_the_same_text_starts_below_its_path_with_the_same_result():
    """match_per_tenant remembers the nodes it matched whole; insert of that very text object starts
    below them while the tree's shape is unchanged.  Random matches, inserts (of the matched text
    and of others), evictions and tenant removals on two trees, one whose inserts never follow a
    match: the same sizes, prefixes, matches and clocks."""
    import random

    rng = random.Random(4)
    for _ in range(300):
        fast, plain = RadixTree(), RadixTree()
        texts = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 12))) for _ in range(8)]
        for _ in range(40):
            op = rng.random()
            tenant = rng.choice(["w0", "w1", "w2"])
            if op < 0.6:
                text = "".join(rng.choice(texts))  # a new object each time: only `is` picks the path
                assert fast.match_per_tenant(text) == plain.match_per_tenant(text)
                if rng.random() < 0.3:  # something else changes the tree in between
                    other = rng.choice(texts)
                    other = other[:rng.randint(1, len(other))] + rng.choice(["", "z"])  # may split an edge only
                    fast.insert(other, tenant)
                    plain.insert(other, tenant)
                if rng.random() < 0.1:
                    n = rng.randint(0, fast.total_size)
                    assert fast.evict(n) == plain.evict(n)
                if rng.random() < 0.2:
                    text = "".join(text)  # an equal text, another object: the walk from the root
                plain._walked = None  # the reference inserts from the root
                fast.insert(text, tenant)
                plain.insert(text, tenant)
            elif op < 0.8:
                n = rng.randint(0, max(0, fast.total_size))
                assert fast.evict(n) == plain.evict(n)
            elif op < 0.85:
                fast.remove_tenant(tenant)
                plain.remove_tenant(tenant)
            else:
                text = rng.choice(texts)
                fast.insert(text, tenant)
                plain.insert(text, tenant)
            for t in ("w0", "w1", "w2"):
                assert fast.tenant_prefixes(t) == plain.tenant_prefixes(t)
            assert fast.tenant_sizes() == plain.tenant_sizes() == fast.recount()
            assert fast.total_size == plain.total_size


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(TEXT, TENANT, st.booleans()), min_size=1, max_size=14), st.data())
def test_retract_leaves_the_tree_of_every_other_insert(inserts, data):
    """A request the worker refused (4xx) is taken back: after inserts i_0..i_n and ``retract`` of
    i_j's claim, every tenant holds exactly the prefixes it would hold had i_j never been inserted,
    whatever came after it (the same text to the same tenant, longer or shorter ones through it,
    other tenants on the same path).  ``walk``: a ``match_per_tenant`` of that very text object first,
    so the insert starts below the matched path (the proxy's order)."""
    j = data.draw(st.integers(0, len(inserts) - 1))
    tree, ref = RadixTree(), NaiveTree()
    claim = None
    for i, (text, tenant, walk) in enumerate(inserts):
        if walk:
            tree.match_per_tenant(text)
        c = tree.insert(text, tenant)
        if i == j:
            claim = c
            assert c is None if not text else c[1] == ref.match_tenant(text, tenant)
        else:
            ref.insert(text, tenant)
    text, tenant, _ = inserts[j]
    before = tree.total_size
    dropped = tree.retract(text, tenant, claim)
    assert dropped == before - tree.total_size
    check_same(tree, ref)


def test_retract_keeps_what_the_tenant_held_before_and_what_a_later_request_added():
    tree = RadixTree()
    tree.insert("system: be brief. user: hi", "a")
    claim = tree.insert("system: be brief. user: bye", "a")
    assert claim[1] == len("system: be brief. user: ")
    assert tree.retract("system: be brief. user: bye", "a", claim) == 3
    assert tree.prefix_match_tenant("system: be brief. user: bye", "a") == len("system: be brief. user: ")
    assert tree.tenant_size("a") == len("system: be brief. user: hi")
    # a later request to the same worker with the same text reached it: nothing is taken back
    claim = tree.insert("another prompt", "a")
    tree.insert("another prompt", "a")
    assert tree.retract("another prompt", "a", claim) == 0
    assert tree.prefix_match_tenant("another prompt", "a") == len("another prompt")
    assert tree.retract("x", "a", None) == 0 and tree.insert("", "a") is None


def test_retract_after_an_eviction_took_the_tail_still_takes_the_rest():
    tree = RadixTree()
    tree.insert("abcdef", "b")
    claim = tree.insert("abcdef", "a")  # a's newest: its tail goes last, so evict b's first ...
    tree.insert("abcdef", "b")  # ... after b touches it again: now a's tail is the oldest leaf
    assert tree.evict(9) == 3 and tree.prefix_match_tenant("abcdef", "a") == 3
    assert tree.retract("abcdef", "a", claim) == 3
    assert tree.tenant_size("a") == 0 and tree.prefix_match_tenant("abcdef", "b") == 6
    assert tree.recount() == tree.tenant_sizes()
