"""cache_aware leaves a matched worker only for that worker's own load (smg's per-candidate gate).

The imbalance test used to be fleet-wide: a busy worker and an idle one anywhere in the
fleet sent *every* hit to the idle worker, even when the worker holding the prefix was
itself lightly loaded.  Now the gate is ``load(matched) - min > abs`` and
``load(matched) > min * rel``, judged for the worker the request would go to.
"""

import pytest

from fleetserve.router.policies import CacheAwarePolicy, over_balance
from fleetserve.router.workers import Worker

PROMPT = "You are a careful assistant. Answer in one line."


def workers(*loads):
    ws = [Worker(f"http://w{i}") for i in range(len(loads))]
    for w, load in zip(ws, loads):
        w.load = load
    return ws


def test_lightly_loaded_owner_keeps_its_prefix_when_another_worker_is_swamped():
    p = CacheAwarePolicy()  # abs 64, rel 1.5 (sglang-router's defaults)
    ws = workers(3, 100, 0)  # w1 is swamped, w2 is idle; w0 holds the prefix
    p.tree.insert(PROMPT, "http://w0")
    # fleet-wide: 100 - 0 > 64 and 100 > 0 -> "imbalanced" -> w2.  Per worker: 3 - 0 <= 64 -> stay on w0.
    assert p.select(ws, PROMPT + " Question 1").url == "http://w0"
    assert (p.hits, p.balanced, p.misses) == (1, 0, 0)


def test_busy_owner_spills_to_the_least_loaded_and_the_spill_is_counted():
    p = CacheAwarePolicy(balance_abs_threshold=4, balance_rel_threshold=1.5)
    ws = workers(10, 2, 5)
    p.tree.insert(PROMPT, "http://w0")
    assert p.select(ws, PROMPT + " Q").url == "http://w1"
    assert (p.hits, p.balanced) == (0, 1)
    # the spilled text now lives under w1 too, so the group can use either copy
    assert p.tree.prefix_match_tenant(PROMPT + " Q", "http://w1") == len(PROMPT) + 2


def test_the_best_owner_is_judged_not_the_busiest_one():
    p = CacheAwarePolicy(balance_abs_threshold=4, balance_rel_threshold=1.5)
    ws = workers(50, 3, 1)
    p.tree.insert(PROMPT, "http://w0")
    p.tree.insert(PROMPT, "http://w1")
    # owners w0 (50) and w1 (3): w1 is the candidate; 3 - 1 <= 4 -> a hit on w1, not a spill to w2
    assert p.select(ws, PROMPT).url == "http://w1"
    assert (p.hits, p.balanced) == (1, 0)


def test_smallest_tree_miss_target_is_judged_by_its_own_load_too():
    p = CacheAwarePolicy(balance_abs_threshold=4, balance_rel_threshold=1.5, cache_miss_fallback="smallest_tree")
    ws = workers(20, 0, 1)
    p.tree.insert("x" * 50, "http://w1")
    p.tree.insert("y" * 50, "http://w2")
    # w0 holds the fewest chars but runs 20 against a minimum of 0: leave it for the least loaded
    assert p.select(ws, "a brand new prompt").url == "http://w1"
    ws[0].load = 3  # 3 - 0 <= 4: the smallest tree keeps it
    assert p.select(ws, "another new prompt").url == "http://w0"


@pytest.mark.parametrize("load,lo,abs_t,rel,over", [
    (65, 0, 64, 1.5, True), (64, 0, 64, 1.5, False),        # absolute gap: strictly greater
    (100, 70, 20, 1.5, False), (106, 70, 20, 1.5, True),    # relative: 105 = 70 * 1.5 is not over
    (10, 10, 0, 1.0, False),                                 # itself the least loaded: never over
])
def test_over_balance_needs_both_margins(load, lo, abs_t, rel, over):
    assert over_balance(load, lo, abs_t, rel) is over
