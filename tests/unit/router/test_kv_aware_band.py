"""kv_aware's balance band (``--kv-balance-band``): under a deep, even backlog the queued-prefill and
load terms count only what a target holds over ``(1 + band) x`` the least loaded target's.

The states are those of docs/benchmarks.md ``routing-kv-rate-window`` (a 2048-token system prompt per
conversation, 384-token turns, 16 decode tokens; about 30 requests, 90k tokens, queued per worker when
kv_aware collapsed).  Hand-built states, no engines: the tree says what A holds, the queue and load
counts are set as the router's bookkeeping would hold them.
"""

import pytest

from fleetserve.router.config import parse_args
from fleetserve.router.kv_events.flags import make_kv_aware
from fleetserve.router.kv_events.policy import BALANCE_BAND, KvAwarePolicy, RouteKey, balance_floor
from fleetserve.router.workers import Worker

from .test_kv_aware_queue import A, B, route_burst

SYSTEM = list(range(1000, 3048))  # conversation 0's 2048-token system prompt, cached on A
PROMPT = SYSTEM + list(range(5000, 5384))  # a 384-token turn after it: 2432 tokens


def state(queued_a: int, queued_b: int, **kw) -> KvAwarePolicy:
    kw.setdefault("backlog_discount", 0)  # the band alone (test_kv_aware_backlog.py has the two together)
    pol = KvAwarePolicy(speculative_ttl_s=0, **kw)
    pol.tree.insert(RouteKey("", SYSTEM).tree_text(), A)
    for url, q in ((A, queued_a), (B, queued_b)):
        pol.queued_tokens[(url, None)] = q
        pol.load_tokens[(url, None)] = q + 30 * 16  # the queued prompts and their decode budgets
    return pol


def route(pol, prompt: list[int] = PROMPT) -> RouteKey:
    """Route ``prompt`` (16 decode tokens) over A and B, each with 30 requests in flight."""
    key = RouteKey("", prompt, 16)
    wa, wb = Worker(A), Worker(B)
    wa.load = wb.load = 30
    pol.select([wa, wb], key)
    return key


def test_the_floor_is_the_band_over_the_lowest():
    assert BALANCE_BAND == 0.5  # on by default since routing-kv-rate-foreign-band (docs/router.md, the balance band)
    assert balance_floor([90_000, 94_000], 0.25) == 112_500
    assert balance_floor([0, 94_000], 0.5) == 0  # an idle target: the plain cost


@pytest.mark.parametrize("band", [0.25, 0.5])
def test_a_4k_difference_on_90k_queues_keeps_the_request_on_its_cache(band):
    old = route(state(94_000, 90_000, balance_band=0))  # without the band: A 384 + 0.5 x 94000 + 0.1 x 94480, B 2432 + ...
    assert old.target == (B, None) and old.cached == 0  # 2400 of balance outweighs the 2048-token hit
    new = route(state(94_000, 90_000, balance_band=band))  # both under (1 + band) x 90000: no balance cost
    assert new.target == (A, None) and new.cached == 2048
    assert route(state(94_000, 90_000)).target == (A, None)  # the default band (0.5) keeps it too


@pytest.mark.parametrize("band", [0.25, 0.5])
def test_a_queue_twice_as_long_still_moves_the_request(band):
    key = route(state(180_000, 90_000, balance_band=band))
    # band 0.5: A 384 + 0.5 x (180000 - 135000) + 0.1 x (180480 - 135720) = 27360 against B's 2432
    assert key.target == (B, None) and key.cached == 0


@pytest.mark.parametrize("band", [0.25, 0.5])
def test_an_idle_or_far_less_loaded_target_still_wins(band):
    assert route(state(10_000, 0, balance_band=band)).target == (B, None)  # floor 0: as without the band
    # 40k against 10k, band 0.25: A 384 + 0.5 x (40000 - 12500) + 0.1 x (40480 - 13100) = 16872, B 2432
    assert route(state(40_000, 10_000, balance_band=band)).target == (B, None)
    assert route(state(2_000, 0, balance_band=band)).target == (A, None)  # under one hit: it stays, as before


@pytest.mark.parametrize("band", [0.25, 0.5])
def test_the_first_turns_of_a_burst_still_spread(band):
    urls, _ = route_burst(KvAwarePolicy(speculative_ttl_s=0, balance_band=band))
    assert urls == [A, B, A, B]


def test_the_flag_reaches_the_policy_and_a_negative_band_is_refused(capsys):
    argv = ["--policy", "kv_aware", "--worker-urls", "http://127.0.0.1:9"]
    assert make_kv_aware(parse_args(argv + ["--kv-balance-band", "0.25"])).balance_band == 0.25
    assert make_kv_aware(parse_args(argv)).balance_band == 0.5
    assert make_kv_aware(parse_args(argv + ["--kv-balance-band", "0"])).balance_band == 0.0
    with pytest.raises(SystemExit) as e:
        parse_args(argv + ["--kv-balance-band", "-0.1"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == \
        "fleetserve router: error: --kv-balance-band must be >= 0"
