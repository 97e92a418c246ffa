"""Routing decisions of each policy on hand-built worker states."""

import random

import pytest

from fleetserve.router.config import RouterConfig
from fleetserve.router.policies import (CacheAwarePolicy, PowerOfTwoPolicy, RandomPolicy, RoundRobinPolicy,
                                        least_loaded, make_policy)
from fleetserve.router.workers import Worker


def workers(*loads):
    ws = [Worker(f"http://w{i}") for i in range(len(loads))]
    for w, load in zip(ws, loads):
        w.load = load
    return ws


def test_imbalance_sends_to_least_loaded_even_on_a_cache_hit():
    p = CacheAwarePolicy(balance_abs_threshold=4, balance_rel_threshold=1.5)
    ws = workers(10, 2, 5)
    p.tree.insert("a long shared system prompt", "http://w0")
    # 10 - 2 > 4 and 10 > 2 * 1.5: imbalanced
    assert p.select(ws, "a long shared system prompt, question 1").url == "http://w1"
    assert p.balanced == 1 and p.hits == 0
    # the text was inserted under the chosen worker
    assert p.tree.prefix_match_tenant("a long shared system prompt, question 1", "http://w1") == 39


@pytest.mark.parametrize("loads", [(10, 7, 8), (70, 50, 60)])
def test_not_imbalanced_when_either_threshold_fails(loads):
    # (10,7): diff 3 <= abs 4; (70,50): diff 20 > 4 but 70 <= 50*1.5
    p = CacheAwarePolicy(balance_abs_threshold=4, balance_rel_threshold=1.5)
    ws = workers(*loads)
    p.tree.insert("hello world", "http://w0")
    assert p.select(ws, "hello world!").url == "http://w0"
    assert p.hits == 1 and p.balanced == 0


def test_match_above_threshold_goes_to_owner_below_goes_to_least_loaded():
    p = CacheAwarePolicy(cache_threshold=0.5)
    ws = workers(3, 1, 2)
    p.tree.insert("abcdefgh", "http://w0")
    # 6 of 10 chars matched: 0.6 > 0.5 -> owner w0 despite its higher load
    assert p.select(ws, "abcdefXXXX").url == "http://w0"
    # 4 of 10 matched: 0.4 <= 0.5 -> miss -> least loaded w1
    assert p.select(ws, "abcdYYYYYY").url == "http://w1"
    assert (p.hits, p.misses) == (1, 1)
    # exactly at the threshold is a miss (strictly greater is required)
    assert p.select(ws, "abcdeZZZZZ").url == "http://w1"
    assert p.misses == 2


def test_several_owners_least_loaded_owner_wins():
    p = CacheAwarePolicy()
    ws = workers(5, 0, 3)
    p.tree.insert("shared prompt", "http://w0")
    p.tree.insert("shared prompt", "http://w2")
    assert p.select(ws, "shared prompt").url == "http://w2"  # w1 is idler but holds nothing


def test_miss_ties_break_by_smaller_tree_then_order():
    p = CacheAwarePolicy()
    ws = workers(0, 0, 0)
    p.tree.insert("xxxxxxxxxxxxxxxx", "http://w0")
    p.tree.insert("yyyy", "http://w1")
    assert p.select(ws, "brand new prompt").url == "http://w2"
    assert least_loaded(workers(1, 1)).url == "http://w0"


def test_sequential_new_prompts_spread_from_an_empty_tree():
    """Nothing in flight, no shared prefix: each miss goes to the smallest tree, so every worker in turn."""
    p = CacheAwarePolicy()
    ws = workers(0, 0, 0)
    got = [p.select(ws, c * 20).url for c in "abcdef"]  # loads stay 0: each answer is over before the next
    assert got == ["http://w0", "http://w1", "http://w2"] * 2


def test_smallest_tree_fallback_ignores_load():
    p = CacheAwarePolicy(cache_miss_fallback="smallest_tree")
    ws = workers(0, 9, 0)
    p.tree.insert("aaaaaaaaaa", "http://w0")
    p.tree.insert("bbbbbbbbbbbbbbbbbbbb", "http://w2")
    assert p.select(ws, "something else").url == "http://w1"


def test_owner_that_is_not_available_is_a_miss():
    p = CacheAwarePolicy()
    ws = workers(0, 0, 0)
    p.tree.insert("conversation one", "http://w0")
    available = ws[1:]  # w0 unhealthy
    chosen = p.select(available, "conversation one, turn two")
    assert chosen.url in {"http://w1", "http://w2"}
    assert p.misses == 1


def test_removed_worker_leaves_the_tree():
    p = CacheAwarePolicy()
    ws = workers(0, 0)
    p.tree.insert("some prompt text", "http://w0")
    p.on_worker_removed("http://w0")
    assert p.tree.tenant_size("http://w0") == 0
    assert p.tree.match("some prompt text") == (0, {})
    assert p.select(ws[1:], "some prompt text").url == "http://w1"


def test_empty_text_routes_by_load_and_inserts_nothing():
    p = CacheAwarePolicy()
    ws = workers(2, 1)
    assert p.select(ws, "").url == "http://w1"
    assert p.tree.total_size == 0


def test_no_workers_gives_none_for_every_policy():
    for name in ("cache_aware", "round_robin", "random", "power_of_two"):
        assert make_policy(name, RouterConfig()).select([], "x") is None


def test_round_robin_random_power_of_two():
    ws = workers(0, 0, 0)
    rr = RoundRobinPolicy()
    assert [rr.select(ws, "").url for _ in range(4)] == ["http://w0", "http://w1", "http://w2", "http://w0"]
    rnd = RandomPolicy(random.Random(0))
    assert {rnd.select(ws, "").url for _ in range(60)} == {w.url for w in ws}
    p2 = PowerOfTwoPolicy(random.Random(0))
    loaded = workers(5, 0, 5)
    picks = [p2.select(loaded, "").url for _ in range(200)]
    # w1 (load 0) wins whenever sampled (2 of 3 pairs); never loses to a busier one
    assert picks.count("http://w1") == pytest.approx(200 * 2 / 3, abs=30)
    assert all(p == "http://w1" or p in ("http://w0", "http://w2") for p in picks)


def test_make_policy_reads_config():
    cfg = RouterConfig(cache_threshold=0.7, balance_abs_threshold=3, balance_rel_threshold=2.0,
                       cache_miss_fallback="smallest_tree")
    p = make_policy("cache_aware", cfg)
    assert (p.cache_threshold, p.abs_threshold, p.rel_threshold, p.smallest_tree) == (0.7, 3, 2.0, True)
    with pytest.raises(ValueError):
        make_policy("fastest", cfg)


# ---------------------------------------------------------------- bounded load
@pytest.mark.parametrize("factor, loads, owned, text, chosen, counters", [
    # loads 3, 2, 1: total 6, cap = ceil(1.5 * 7 / 3) = 4; owner w0 would reach 4 <= 4: it keeps the request
    (1.5, (3, 2, 1), "system prompt of group one", "system prompt of group one, question", "http://w0", (1, 0, 0)),
    # the only owner is over the cap and nobody else matches enough: a miss among candidates.
    # total 8, cap = ceil(9 / 3) = 3: w0 (4 + 1 > 3) is out; w1, w2 tie at 2 -> smaller tree (both 0) -> w1
    (1.0, (4, 2, 2), "abcdefgh", "abcdefgh", "http://w1", (0, 1, 1)),
], ids=["owner-under-cap", "owner-over-cap-miss"])
def test_bounded_load_owner_under_and_over_the_cap(factor, loads, owned, text, chosen, counters):
    p = CacheAwarePolicy(bounded_load_factor=factor, bounded_load_slack=0)
    p.tree.insert(owned, "http://w0")
    assert p.select(workers(*loads), text).url == chosen
    assert (p.hits, p.misses, p.balanced) == counters


def test_bounded_load_spills_a_hot_prefix_to_the_next_best_match():
    # loads 5, 1, 0: total 6, cap = ceil(1.25 * 7 / 3) = 3; w0 (the full owner) is over it.
    # w1 holds 14 of the prompt's chars, w2 none: w1 is the best candidate under the cap.
    p = CacheAwarePolicy(cache_threshold=0.3, bounded_load_factor=1.25, bounded_load_slack=0)
    ws = workers(5, 1, 0)
    text = "system prompt of group one, question"
    p.tree.insert(text, "http://w0")
    p.tree.insert("system prompt ", "http://w1")
    assert p.tree.match_per_tenant(text) == {"http://w0": len(text), "http://w1": 14}
    assert p.select(ws, text).url == "http://w1"  # 14/36 = 0.39 > 0.3: a hit on w1
    assert (p.hits, p.balanced) == (1, 1)
    # the text is now under w1 too: the next request of the group matches w1 fully
    assert p.tree.prefix_match_tenant(text, "http://w1") == len(text)


def test_bounded_load_never_lets_a_worker_exceed_the_cap():
    # a single hot prefix and 200 arrivals with no completions: loads stay within the bound at every step
    import math

    c, slack = 1.25, 3
    p = CacheAwarePolicy(bounded_load_factor=c, bounded_load_slack=slack)
    ws = workers(0, 0, 0, 0)
    for i in range(200):
        total = sum(w.load for w in ws)
        cap = math.ceil(c * (total + 1) / len(ws)) + slack
        w = p.select(ws, f"one shared system prompt for everyone; question {i}")
        w.load += 1
        assert w.load <= cap
    assert max(w.load for w in ws) <= math.ceil(c * 200 / 4) + slack
    assert min(w.load for w in ws) > 0  # the hot prefix spilled over every worker


def test_bounded_load_factor_below_one_is_rejected():
    with pytest.raises(ValueError):
        CacheAwarePolicy(bounded_load_factor=0.5)
    with pytest.raises(ValueError):
        RouterConfig(bounded_load_factor=0.9).validate()
    p = make_policy("cache_aware", RouterConfig(bounded_load_factor=1.25))
    assert p.bounded_load_factor == 1.25


def test_bounded_load_slack_keeps_a_lightly_loaded_owner():
    # loads 3, 1, 1, 1: total 6, ceil(1.25 * 7 / 4) = 3, so w0 (3 + 1) is over the bare cap,
    # but within the default slack of 4: the request stays on its cache
    p = CacheAwarePolicy(bounded_load_factor=1.25)
    ws = workers(3, 1, 1, 1)
    p.tree.insert("system prompt of group one", "http://w0")
    assert p.select(ws, "system prompt of group one, q").url == "http://w0"
    p0 = CacheAwarePolicy(bounded_load_factor=1.25, bounded_load_slack=0)
    p0.tree.insert("system prompt of group one", "http://w0")
    assert p0.select(ws, "system prompt of group one, q").url != "http://w0"
    with pytest.raises(ValueError):
        CacheAwarePolicy(bounded_load_factor=1.25, bounded_load_slack=-1)


def test_round_robin_retries_do_not_shift_the_rotation():
    # w1 fails every time: the router retries on the workers not tried yet (here [w0]); the next
    # request must still take its turn after w1, so w1 gets every second first attempt, not all
    ws = workers(0, 0)
    rr = RoundRobinPolicy()
    first = []
    for _ in range(10):
        w = rr.select(ws, "")
        first.append(w.url)
        if w.url == "http://w1":
            assert rr.select([ws[0]], "", retry=True).url == "http://w0"
    assert first == ["http://w0", "http://w1"] * 5


def test_cache_aware_forgets_a_flushed_workers_tree_entries():
    """After a worker answered /flush_cache its cache is empty: its tree entries go, the others' stay."""
    p = CacheAwarePolicy()
    p.tree.insert("shared system prompt and a question", "http://a:1")
    p.tree.insert("shared system prompt and another one", "http://b:1")
    p.on_cache_flushed("http://a:1")
    assert set(p.tree.tenant_sizes()) == {"http://b:1"}
