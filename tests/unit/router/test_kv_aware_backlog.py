"""kv_aware's backlog discount (``--kv-backlog-discount``): when every target has prefill queued,
the queued-prefill term weighs less, so a difference between deep queues stops moving requests off
their cache.

The states are modelled on a router debug log taken at the settings of docs/benchmarks.md
``routing-kv-rate-backlog-request`` (a 2048-token system prompt per conversation, 384-token turns; 30%
of the traffic straight to random workers, so the workers' queues differ by chance), where the full
term moved a turn whose worker held 3264 of its 3680 tokens and had 67k tokens queued to one with
33k: here a 2432-token turn with 2048 cached, 66k against 33k.  Hand-built states, no engines: the
tree says what A holds, the queue and load counts are set as the router's bookkeeping would hold
them (no queued requests of its own: the unit is the prompt).
"""

import pytest

from fleetserve.router.config import parse_args
from fleetserve.router.kv_events.flags import make_kv_aware
from fleetserve.router.kv_events.policy import BACKLOG_DISCOUNT, KvAwarePolicy, RouteKey, queue_weight_under
from fleetserve.router.workers import Worker

from .test_kv_aware_band import SYSTEM, route  # a 2432-token turn whose 2048-token system prompt A holds
from .test_kv_aware_queue import A, B, route_burst



def state(queued_a: int, queued_b: int, load: int = 50_000, **kw) -> KvAwarePolicy:
    pol = KvAwarePolicy(speculative_ttl_s=0, **kw)
    pol.tree.insert(RouteKey("", SYSTEM).tree_text(), A)
    for url, q in ((A, queued_a), (B, queued_b)):
        pol.queued_tokens[(url, None)] = q
        pol.load_tokens[(url, None)] = load  # alike: only the queues differ
    return pol


def test_the_weight_falls_with_the_backlog_in_units_of_a_queued_request():
    assert BACKLOG_DISCOUNT == 1.0  # on since routing-kv-rate-backlog-request-2 (docs/router.md, the backlog discount)
    assert queue_weight_under(0.5, 0, 2432, 1.0) == 0.5  # an empty target somewhere: as set
    assert queue_weight_under(0.5, 2432, 2432, 1.0) == 0.25  # one prompt queued on every target: half
    assert queue_weight_under(0.5, 2432, 2432, 3.0) == 0.125
    assert queue_weight_under(0.5, 24_320, 2432, 1.0) == pytest.approx(0.5 / 11)
    assert queue_weight_under(0.5, 1000, 0, 1.0) == 0.5  # no unit (an empty prompt, nothing queued): as set


def test_a_deep_uneven_backlog_moves_the_turn_off_its_cache_without_the_discount():
    key = route(state(66_000, 33_000, backlog_discount=0))
    # band 0.5: A 384 + 0.5 x (66000 - 49500) = 8634 against B's 2432
    assert key.target == (B, None) and key.cached == 0


@pytest.mark.parametrize("discount", [1.0, 2.0])
def test_with_the_discount_the_turn_stays_on_its_cache(discount):
    key = route(state(66_000, 33_000, backlog_discount=discount))
    # discount 1: weight 0.5 / (1 + 33000 / 2432) = 0.0343; A 384 + 0.0343 x 16500 = 950 < 2432
    assert key.target == (A, None) and key.cached == 2048


def test_an_idle_target_still_wins_and_a_shallow_backlog_still_moves():
    pol = state(10_000, 0, load=10_000, backlog_discount=1.0)
    assert route(pol).target == (B, None)  # least queued 0: the full term (A 384 + 5000 against 2432)
    # least queued 2000: weight 0.5 / (1 + 2000 / 2432) = 0.274, A 384 + 0.274 x (12000 - 3000) = 2851 > 2432
    assert route(state(12_000, 2_000, load=10_000, backlog_discount=1.0)).target == (B, None)


def test_the_discount_never_moves_a_request_the_plain_cost_keeps():
    for qa, qb in ((34_000, 33_000), (2_000, 0), (8_000, 6_000)):
        assert route(state(qa, qb, backlog_discount=0)).target == (A, None)
        assert route(state(qa, qb, backlog_discount=1.0)).target == (A, None)


def test_the_first_turns_of_a_burst_still_spread():
    urls, _ = route_burst(KvAwarePolicy(speculative_ttl_s=0, backlog_discount=1.0))
    assert urls == [A, B, A, B]


def test_the_flag_reaches_the_policy_and_a_negative_discount_is_refused(capsys):
    argv = ["--policy", "kv_aware", "--worker-urls", "http://127.0.0.1:9"]
    assert make_kv_aware(parse_args(argv + ["--kv-backlog-discount", "1"])).backlog_discount == 1.0
    assert make_kv_aware(parse_args(argv)).backlog_discount == BACKLOG_DISCOUNT
    with pytest.raises(SystemExit) as e:
        parse_args(argv + ["--kv-backlog-discount", "-1"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == \
        "fleetserve router: error: --kv-backlog-discount must be >= 0"


def test_a_short_prompt_is_not_held_behind_a_much_longer_queue():
    """A user trial's state: 64 of a 100-token prompt cached on A, 66k queued there against 33k.
    Counted in prompts (100 tokens) the backlog is 330 of them and the weight 0.0015: the request
    would wait 33k more tokens to save 64.  Counted in the router's queued requests (22 of 1500
    uncached tokens on average) the weight is 0.0217 and A's excess 16.5k costs 358 > 64: it moves."""
    short = list(range(1000, 1064))
    prompt = short + list(range(7000, 7036))
    pol = KvAwarePolicy(speculative_ttl_s=0, backlog_discount=1.0)
    pol.tree.insert(RouteKey("", short).tree_text(), A)
    for url, q in ((A, 66_000), (B, 33_000)):
        pol.queued_tokens[(url, None)] = q
        pol.load_tokens[(url, None)] = 50_000
    pol.queued_requests, pol.queued_sum = 22, 33_000
    key = route(pol, prompt)
    assert key.target == (B, None) and key.cached == 0
    # and the 2432-token turn with 2048 cached still stays at that unit: 384 + 0.0217 x 16500 = 742 < 2432
    long_turn = state(66_000, 33_000, backlog_discount=1.0)
    long_turn.queued_requests, long_turn.queued_sum = 22, 33_000
    assert route(long_turn).target == (A, None)


def test_the_unit_counts_follow_the_queued_requests_back_to_zero():
    pol = KvAwarePolicy(speculative_ttl_s=0)
    wa, wb = Worker(A), Worker(B)
    keys = []
    for i in range(4):  # four new prompts of 300 + i tokens: nothing cached, each queued in full
        key = RouteKey("", list(range(10_000 * (i + 1), 10_000 * (i + 1) + 300 + i)), 16)
        pol.select([wa, wb], key)
        keys.append(key)
    assert pol.queued_requests == 4 and pol.queued_sum == 300 + 301 + 302 + 303
    pol.prefilled(keys[0])  # its prefill ended: no longer queued
    assert pol.queued_requests == 3 and pol.queued_sum == 301 + 302 + 303
    pol.prefilled(keys[0])  # twice: nothing more
    assert pol.queued_requests == 3
    for key in keys:
        pol.release(key)
    assert pol.queued_requests == 0 and pol.queued_sum == 0 and not pol.queued_tokens
