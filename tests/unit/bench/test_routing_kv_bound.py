"""benchmarks/routing_kv.py: the hit-rate bounds (infinite cache, and own worker for direct traffic)."""

import random

import pytest
from helpers.bench_module import load_bench


@pytest.fixture(scope="module")
def rk():
    return load_bench("routing_kv")


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


SYS = seq(1000, 64)  # four pages of 16


def test_infinite_bound_counts_whole_pages_of_prompt_minus_last(rk):
    a = SYS + seq(1, 20)
    b = SYS + seq(1, 20) + seq(50, 5)  # a's 84 tokens are a prefix: 5 whole pages of a's prompt
    c, t = rk.infinite_cache_bound([a, b])
    assert t == len(a) + len(b) == 173
    assert c == 5 * 16


def test_no_direct_traffic_is_the_infinite_bound(rk):
    rng = random.Random(3)
    prompts = [SYS[:rng.choice([16, 32, 64])] + seq(rng.randrange(3) * 100, rng.randrange(1, 60)) for _ in range(40)]
    assert rk.split_cache_bound(prompts, [None] * len(prompts)) == rk.infinite_cache_bound(prompts)


def test_direct_request_sees_only_its_own_workers_direct_prompts(rk):
    p = SYS + seq(1, 40)
    # the same prompt twice, straight to two different workers: the second finds nothing
    assert rk.split_cache_bound([p, p], [0, 1]) == (0, 2 * len(p))
    # to the same worker twice: it hits (everything but the last token, whole pages: 6 pages)
    assert rk.split_cache_bound([p, p], [1, 1]) == (6 * 16, 2 * len(p))
    # the infinite bound lets the second hit in both cases
    assert rk.infinite_cache_bound([p, p]) == (6 * 16, 2 * len(p))


def test_routed_prompts_are_available_to_every_worker(rk):
    p = SYS + seq(1, 40)
    # routed first: a router could have put it on worker 2, so a direct request there may hit
    assert rk.split_cache_bound([p, p], [None, 2])[0] == 6 * 16
    # direct first, then routed: the router can send it to that worker
    assert rk.split_cache_bound([p, p], [3, None])[0] == 6 * 16


def test_hit_stops_at_the_first_page_its_worker_cannot_hold(rk):
    routed = SYS  # 4 pages any worker may hold
    other = SYS + seq(1, 48)  # 7 pages, direct to worker 0
    mine = SYS + seq(1, 48) + seq(90, 9)  # direct to worker 1: only the routed 4 pages count
    c, _ = rk.split_cache_bound([routed, other, mine], [None, 0, 1])
    assert c == 0 + 4 * 16 + 4 * 16  # routed: nothing before it; other: the routed 4 pages; mine: the same 4
    c_inf, _ = rk.infinite_cache_bound([routed, other, mine])
    assert c_inf == 0 + 4 * 16 + 7 * 16  # mine may hit all of other's 7 pages there


def test_split_bound_never_above_the_infinite_one(rk):
    rng = random.Random(0)
    for _ in range(20):
        prompts, dest = [], []
        for _ in range(30):
            prompts.append(SYS[:16 * rng.randrange(5)] + seq(rng.randrange(4) * 100, rng.randrange(1, 70)))
            dest.append(rng.choice([None, None, 0, 1, 2]))
        c2, t2 = rk.split_cache_bound(prompts, dest)
        c1, t1 = rk.infinite_cache_bound(prompts)
        assert t1 == t2 and c2 <= c1


def test_a_pool_that_holds_everything_is_the_infinite_bound(rk):
    rng = random.Random(5)
    prompts = [SYS[:rng.choice([16, 32, 64])] + seq(rng.randrange(4) * 100, rng.randrange(1, 70)) for _ in range(60)]
    assert rk.finite_pool_bound(prompts, 10**6) == rk.infinite_cache_bound(prompts)
    assert rk.finite_pool_bound(prompts, 0) == (0, sum(len(p) for p in prompts))


def test_the_pool_keeps_the_prompt_that_comes_back_and_drops_the_one_that_does_not(rk):
    a = SYS + [1]  # 4 whole pages looked up, 4 inserted
    b = seq(5000, 64) + [2]  # 4 other pages, never used again
    # a pool of 4 pages: LRU would keep b and miss a's return; the bound keeps a (b's pages go at once)
    assert rk.finite_pool_bound([a, b, a], 4 * 16) == (4 * 16, 3 * 65)
    assert rk.finite_pool_bound([a, b, a], 3 * 16) == (3 * 16, 3 * 65)  # room for 3 of a's: its first 3
    # two conversations on one system prompt and a pool of 5 pages: the shared 4 stay, plus one own page
    c, d = SYS + seq(1, 16) + [3], SYS + seq(100, 16) + [4]
    assert rk.finite_pool_bound([c, d, c, d], 5 * 16) == ((4 + 5 + 4) * 16, 4 * 81)


def test_the_pool_bound_never_exceeds_the_infinite_one_and_grows_with_the_pool(rk):
    rng = random.Random(11)
    for _ in range(20):
        prompts = [SYS[:rng.choice([0, 16, 48])] + seq(rng.randrange(3) * 100, rng.randrange(1, 50))
                   for _ in range(rng.randrange(2, 30))]
        inf = rk.infinite_cache_bound(prompts)[0]
        got = [rk.finite_pool_bound(prompts, pages * 16)[0] for pages in (1, 2, 4, 8, 16, 64)]
        assert got == sorted(got) and got[-1] <= inf


class _Req:
    def __init__(self, group: int):
        self.group = group


def test_direct_destinations_by_conversation_pins_each_conversation(rk):
    """--foreign-by conversation: a conversation's direct requests all reach one worker; which requests go
    direct and which replica a routed one reaches are the draws of --foreign-by request."""
    reqs = [_Req(g) for _ in range(6) for g in range(40)]
    urls, rurls = ["w0", "w1", "w2", "w3"], ["r0", "r1"]
    per_req = rk.direct_destinations(reqs, urls, rurls, 0.3, 5, "request")
    per_conv = rk.direct_destinations(reqs, urls, rurls, 0.3, 5, "conversation")
    assert [d in urls for d in per_req] == [d in urls for d in per_conv]
    assert [d for d in per_req if d in rurls] == [d for d in per_conv if d in rurls]
    direct = sum(d in urls for d in per_conv)
    assert 0.2 * len(reqs) < direct < 0.4 * len(reqs)
    homes: dict = {}
    for r, d in zip(reqs, per_conv):
        if d in urls:
            assert homes.setdefault(r.group, d) == d
    assert len(set(homes.values())) == 4  # conversations spread over every worker
    spread: dict = {}
    for r, d in zip(reqs, per_req):
        if d in urls:
            spread.setdefault(r.group, set()).add(d)
    assert any(len(s) > 1 for s in spread.values())  # per request, a conversation's direct turns scatter


def test_follow_cache_discounts_only_a_conversations_first_direct_request_after_routed_ones(rk):
    """Conversation a: routed, then direct to worker 0 (first direct after a routed one: its 4-page hit is
    expected only 1 time in 4), then direct again (its worker now holds the previous direct prompt: the
    full hit).  Conversation b starts direct, so nothing of b is discounted."""
    a0 = SYS + seq(1, 16)  # 5 pages
    a1 = a0 + seq(100, 16)  # a0's 5 pages are a prefix of a1's first 95 tokens
    a2 = a1 + seq(200, 16)
    b0 = seq(5000, 48)
    b1 = b0 + seq(300, 16)
    b2 = b1 + seq(400, 16)
    prompts = [a0, b0, a1, b1, a2, b2]
    direct_to = [None, 1, 0, None, 0, 1]
    groups = ["a", "b", "a", "b", "a", "b"]
    own = rk.split_cache_hits(prompts, direct_to)
    assert own == [0, 0, 80, 48, 96, 64]
    got = rk.follow_cache_hits(prompts, direct_to, groups, 4)
    assert got == [0, 0, 80 / 4, 48, 96, 64]
    assert rk.follow_cache_hits(prompts, direct_to, groups, 1) == own  # one worker: nothing to miss


def test_follow_cache_keeps_what_other_conversations_routed(rk):
    """x and y share a 2-page system prompt; x's first direct request after a routed one still finds y's
    routed pages (the router may have put them on its worker), so the miss case keeps those 32 tokens."""
    shared = seq(7000, 32)
    x0, y0 = shared + seq(1, 32), shared + seq(500, 32)
    x1 = x0 + seq(2, 16)
    got = rk.follow_cache_hits([x0, y0, x1], [None, None, 3], ["x", "y", "x"], 4)
    assert got[:2] == [0, 32]
    assert got[2] == pytest.approx(64 / 4 + 3 / 4 * 32)
    never_above = rk.split_cache_hits([x0, y0, x1], [None, None, 3])
    assert all(f <= o for f, o in zip(got, never_above))


def test_greedy_follow_routes_each_request_to_its_longest_prefix(rk):
    """Routed requests follow their prefix; a direct one to another worker finds nothing of it there."""
    a0 = SYS + seq(1, 16)
    a1 = a0 + seq(100, 16)  # routed: follows a0 wherever it went (80 tokens)
    a2 = a1 + seq(200, 16)  # direct to a worker a's prompts may not be on
    b0 = seq(5000, 48)
    prompts = [a0, a1, b0, a2]
    # with one worker every request finds all of its history
    assert rk.greedy_follow_hits(prompts, [None, None, None, 0], 1) == 80 + 96
    # four workers: a0 lands at random, a1 follows it; a2 direct to worker 2 hits 96 only where a went
    got = rk.greedy_follow_hits(prompts, [None, None, None, 2], 4, seeds=400)
    assert 80 + 96 / 4 * 0.8 < got < 80 + 96 / 4 * 1.2
    assert rk.greedy_follow_hits(prompts, [None, None, None, 2], 4, seeds=3) == \
        rk.greedy_follow_hits(prompts, [None, None, None, 2], 4, seeds=3)  # seeded


def test_greedy_follow_matches_the_expectation_when_direct_traffic_is_pinned(rk):
    """On a pinned stream (each conversation's direct requests to one worker) the simulated router's mean
    agrees with follow_cache_hits, and both stay at or under the own-worker bound."""
    rng = random.Random(3)
    convs = 40
    home = [rng.randrange(4) for _ in range(convs)]
    hist = [seq(10000 * c, 64) for c in range(convs)]  # a 4-page system prompt each
    prompts, direct_to, groups = [], [], []
    for t in range(4):
        for c in range(convs):
            hist[c] = hist[c] + seq(10000 * c + 1000 * (t + 1), 24)
            prompts.append(list(hist[c]))
            direct_to.append(home[c] if rng.random() < 0.3 else None)
            groups.append(c)
    expect = sum(rk.follow_cache_hits(prompts, direct_to, groups, 4))
    greedy = rk.greedy_follow_hits(prompts, direct_to, 4, seeds=64)
    own = sum(rk.split_cache_hits(prompts, direct_to))
    assert greedy <= own and expect <= own
    assert abs(greedy - expect) < 0.03 * own
    assert expect < 0.95 * own  # the discount is visible on this stream
