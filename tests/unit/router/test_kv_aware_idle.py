"""kv_aware's idle rule: a request leaves the lowest-cost target for an idle one when its wait there is
longer by more than ``--kv-balance-abs-threshold`` tokens and ``--kv-balance-rel-threshold`` times.

The states are those of the router's debug log for shared_prefix on 2 real CPU engines with a
2048-token pool (docs/benchmarks.md ``routing-kv-engine-2``): a group's 520-token system prompt, 38-token
questions (558 tokens a prompt), 16 decode tokens.  Hand-built states, no engines.
"""

import pytest

from fleetserve.router.config import parse_args
from fleetserve.router.kv_events.policy import IDLE_ABS_THRESHOLD, IDLE_REL_THRESHOLD, RouteKey, idle_rule
from fleetserve.router.workers import Worker

from .test_kv_aware_shared_prefix import A, B, policy, prompt, queued, store, system


def test_the_rule_is_sglang_routers_balance_test_on_waits():
    assert (IDLE_ABS_THRESHOLD, IDLE_REL_THRESHOLD) == (160.0, 1.2)
    assert idle_rule(737.3, 558, 160, 1.2)  # gap 179.3, ratio 1.32
    assert not idle_rule(693.5, 558, 160, 1.2)  # gap 135.5: too small
    assert idle_rule(400, 230, 160, 1.2)  # gap 170 at ratio 1.74
    assert not idle_rule(2300, 2100, 160, 1.2)  # gap 200 but ratio 1.095: a long prompt stays
    assert not idle_rule(10_000, 0, 160, 0)  # rel 0: off


def state(inflight: int, **kw):
    """A holds group 0's system prompt (its events) and has ``inflight`` requests routed there, their
    prefills not ended: another group's whole prompt (555 uncached), then group-0 questions (38 each).
    B holds nothing and has nothing in flight (idle)."""
    pol = policy(speculative_ttl_s=0, **kw)
    store(pol, A, system(0))
    wa = Worker(A)
    wa.load = 0
    sent = [queued(pol, [wa], prompt(1, 0))] + [queued(pol, [wa], prompt(0, p)) for p in range(1, inflight)]
    assert sent == [555] + [38] * (inflight - 1)
    wa.load = inflight  # the registry's in-flight count (the proxy keeps it)
    return pol, wa


def test_a_prompt_behind_three_prefills_goes_to_the_idle_worker():
    # the log's decision 47: 3 prompts in flight on the group's worker, 630 tokens queued, the other idle
    pol, wa = state(3)
    wb = Worker(B)
    key = RouteKey("", prompt(0, 3), 16)
    # A: wait 38 + 631 + 0.1 x 683 = 737.3 (cost 38 + 0.5 x 631 + 68.3 = 421.8); B: 558, cost 558
    assert pol.select([wa, wb], key).url == B and key.cached == 0 and pol.idle_moves == 1
    assert key.route_header().startswith(f"target={B}; dp_rank=-; branch=exact; cached_tokens=0")
    assert pol.queued_tokens[(B, None)] == 558  # charged to B as any decision is
    old, wa = state(3, balance_rel_threshold=0)  # the rule off: the cost alone keeps it on A
    key = RouteKey("", prompt(0, 3), 16)
    assert old.select([wa, Worker(B)], key).url == A and key.cached == 520 and old.idle_moves == 0


def test_a_prompt_behind_two_prefills_stays_with_its_system_prompt():
    pol, wa = state(2)  # A: wait 38 + 593 + 0.1 x 629 = 693.9, gap 135.9 < 160
    key = RouteKey("", prompt(0, 2), 16)
    assert pol.select([wa, Worker(B)], key).url == A and key.cached == 520 and pol.idle_moves == 0
    pol, wa = state(2, balance_abs_threshold=128)  # a lower threshold moves it
    key = RouteKey("", prompt(0, 2), 16)
    assert pol.select([wa, Worker(B)], key).url == B and pol.idle_moves == 1


def test_a_busy_target_is_no_idle_target_however_short_its_wait():
    pol, wa = state(3)
    wb = Worker(B)
    wb.load = 1  # one short request in flight on B: B's own tokens would delay it, so the cost decides
    pol.load_tokens[(B, None)] = 20
    pol.inflight[(B, None)] = 1
    key = RouteKey("", prompt(0, 3), 16)
    assert pol.select([wa, wb], key).url == A and pol.idle_moves == 0


def test_the_idle_target_that_waits_least_is_the_one_moved_to():
    pol, wa = state(3)
    C = "http://c:1"
    pol.subs[C] = dict(pol.subs[B])
    store(pol, C, system(0)[:200])  # C, idle too, holds the first 200 tokens of the system prompt
    key = RouteKey("", prompt(0, 3), 16)
    assert pol.select([wa, Worker(B), Worker(C)], key).url == C and key.cached == 200


def test_the_first_turns_of_a_burst_still_spread_and_a_single_target_is_never_moved():
    pol = policy(speculative_ttl_s=0)
    wa, wb = Worker(A), Worker(B)
    urls = [pol.select([wa, wb], RouteKey("", prompt(g, 0), 16)).url for g in range(4)]
    assert urls == [A, B, A, B] and pol.idle_moves == 0
    pol, wa = state(3)
    key = RouteKey("", prompt(0, 3), 16)
    pol.pin(wa, key)  # --sticky-sessions chose A: nothing to move to
    assert key.target == (A, None) and pol.idle_moves == 0


@pytest.mark.parametrize("argv, err", [
    (["--kv-balance-rel-threshold", "0.5"], "--kv-balance-rel-threshold must be 0 (off) or >= 1"),
    (["--kv-balance-abs-threshold", "-1"], "--kv-balance-abs-threshold must be >= 0"),
])
def test_bad_thresholds_are_refused_in_one_line_naming_the_flag(argv, err, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--policy", "kv_aware", "--worker-urls", "http://127.0.0.1:9", *argv])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"fleetserve router: error: {err}"


def test_the_flags_reach_the_policy():
    from fleetserve.router.kv_events.flags import make_kv_aware

    cfg = parse_args(["--policy", "kv_aware", "--worker-urls", "http://127.0.0.1:9",
                      "--kv-balance-abs-threshold", "64", "--kv-balance-rel-threshold", "0"])
    pol = make_kv_aware(cfg)
    assert (pol.balance_abs_threshold, pol.balance_rel_threshold) == (64.0, 0.0)
    pol = make_kv_aware(parse_args(["--policy", "kv_aware", "--worker-urls", "http://127.0.0.1:9"]))
    assert (pol.balance_abs_threshold, pol.balance_rel_threshold) == (160.0, 1.2)
