"""kv_aware's router queue (``--router-queue-threshold``): requests wait in the router while every
target's queued prefill is over the threshold, first come first served, and each is routed when one frees."""

import asyncio
import time

import pytest

from fleetserve.router.config import RouterConfig, build_parser
from fleetserve.router.kv_events.flags import validate
from fleetserve.router.kv_events.loads import EngineLoads
from fleetserve.router.kv_events.metrics import families
from fleetserve.router.kv_events.policy import KvAwarePolicy, RouteKey
from fleetserve.router.kv_events.router_queue import DEFAULT_BUDGET, budget_from_info
from fleetserve.router.workers import Worker

A, B = "http://a:1", "http://b:1"


def prompt(n: int, first: int = 0) -> list[int]:
    return list(range(first, first + n))


def policy(threshold: float, budget: int = 1000, **kw) -> tuple[KvAwarePolicy, list[Worker]]:
    pol = KvAwarePolicy(speculative_ttl_s=0, router_queue_threshold=threshold, **kw)
    workers = [Worker(A), Worker(B)]
    for w in workers:
        pol.router_queue.budgets[w.url] = budget
    return pol, workers


async def arrive(pol, workers, ids, stream=True):
    """What the proxy does with one request: prepare (which may wait), then select."""
    key = await pol.prepare("/v1/completions", {"prompt": ids, "max_tokens": 1, "stream": stream}, "")
    return key, pol.select(workers, key)


def test_budget_from_info_takes_the_first_reported_field():
    assert budget_from_info({"chunked_prefill_size": 2048, "max_num_batched_tokens": 512}) == 2048
    assert budget_from_info({"chunked_prefill_size": -1, "max_num_batched_tokens": 512}) == 512  # chunking off
    assert budget_from_info({"chunked_prefill_size": None, "max_prefill_tokens": 16384}) == 16384
    assert budget_from_info({"chunked_prefill_size": True, "max_prefill_tokens": "8k"}) is None  # not ints
    assert budget_from_info({}) is None


def test_servers_report_one_rank_s_prefill_budget_as_sglang_does():
    from fleetserve.entrypoints.server_info import router_discovery_fields

    plain = router_discovery_fields({"chunked_prefill_size": 8192, "max_prefill_tokens": 16384, "dp_size": 2})
    assert (plain["chunked_prefill_size"], plain["max_prefill_tokens"]) == (8192, 16384)  # plain DP: each rank's
    dpa = router_discovery_fields({"chunked_prefill_size": 8192, "dp_size": 4, "enable_dp_attention": True})
    assert dpa["chunked_prefill_size"] == 2048  # DP attention: SGLang's server_args hold 8192 // dp_size
    off = router_discovery_fields({"chunked_prefill_size": -1, "dp_size": 4, "enable_dp_attention": True,
                                   "max_prefill_tokens": 16384})
    assert off["chunked_prefill_size"] == -1 and budget_from_info(off) == 16384  # chunking off: the batch cap


def test_busy_compares_the_larger_of_router_and_engine_queued_prefill_with_threshold_times_budget():
    pol, _ = policy(0.5, budget=1000)
    q = pol.router_queue
    now = time.monotonic()
    pol.queued_tokens[(A, None)] = 500
    assert not q.busy(A, None, now)  # 500 is not over 0.5 x 1000
    pol.queued_tokens[(A, None)] = 501
    assert q.busy(A, None, now)
    el = pol.engine_loads = EngineLoads(1.0)
    el.put(B, {0: 0}, now, waiting={0: 900})  # traffic this router never saw waits on B's engine
    assert q.busy(B, None, now)
    el.put(B, {0: 0}, now, waiting={0: 100})
    assert not q.busy(B, None, now)
    pol.dp_ranks[B] = (0, 1)  # a whole worker of 2 DP ranks has twice the budget
    el.put(B, {0: 0, 1: 0}, now, waiting={0: 600, 1: 300})
    assert not q.busy(B, None, now)  # 900 <= 0.5 x 2 x 1000
    assert q.busy(B, 0, now) and not q.busy(B, 1, now)  # --dp-aware: one rank's budget each
    assert q.budget("http://unknown:1") == DEFAULT_BUDGET


async def test_requests_wait_while_every_target_is_busy_and_leave_in_arrival_order():
    pol, workers = policy(0.5, budget=1000)
    q = pol.router_queue
    k1, w1 = await arrive(pol, workers, prompt(800))  # 800 queued on one worker: busy
    k2, w2 = await arrive(pol, workers, prompt(800, 5000))  # the other one: every target busy now
    assert {w1.url, w2.url} == {A, B} and not k1.held and not k2.held
    t3 = asyncio.create_task(arrive(pol, workers, prompt(700, 9000)))
    t4 = asyncio.create_task(arrive(pol, workers, prompt(600, 20000)))
    await asyncio.sleep(0.02)
    assert q.pending == 2 and not t3.done() and not t4.done()
    assert q.held_total == 2
    pol.prefilled(k2)  # k2's prefill ends: its target is free, the head (t3) goes there
    k3, w3 = await asyncio.wait_for(t3, 1)
    assert w3.url == w2.url and k3.prompt_tokens == 700
    await asyncio.sleep(0.02)
    assert q.pending == 1 and not t4.done()  # 700 now queued there again: every target busy
    pol.prefilled(k1)
    k4, w4 = await asyncio.wait_for(t4, 1)
    assert w4.url == w1.url
    assert q.pending == 0 and q._leaving == 0 and not k3.held and not k4.held
    assert q.wait_seconds_total > 0
    names = {f.name: f for f in families(pol)}
    assert names["fleetserve_router_kv_router_queue_pending_requests"].samples[0].value == 0
    assert names["fleetserve_router_kv_router_queue_held"].samples[0].value == 2


async def test_a_new_request_does_not_overtake_one_that_waits():
    pol, workers = policy(0.5, budget=1000)
    q = pol.router_queue
    k1, _ = await arrive(pol, workers, prompt(800))
    k2, _ = await arrive(pol, workers, prompt(800, 5000))
    t3 = asyncio.create_task(arrive(pol, workers, prompt(10, 9000)))
    await asyncio.sleep(0.01)
    pol.prefilled(k1)  # A frees up: t3 is let go, but has not been routed yet when t4 arrives
    t4 = asyncio.create_task(arrive(pol, workers, prompt(10, 20000)))
    k3, _ = await asyncio.wait_for(t3, 1)
    k4, _ = await asyncio.wait_for(t4, 1)  # 10 tokens on A: not busy, t4 goes next
    assert k3.charged[2] <= k4.charged[2]  # routed in arrival order
    assert q.held_total == 2 and q.pending == 0 and q._leaving == 0


async def test_a_client_that_goes_away_leaves_the_queue_and_the_next_one_keeps_its_turn():
    pol, workers = policy(0.5, budget=1000)
    q = pol.router_queue
    k1, _ = await arrive(pol, workers, prompt(800))
    await arrive(pol, workers, prompt(800, 5000))
    t3 = asyncio.create_task(arrive(pol, workers, prompt(10, 9000)))
    t4 = asyncio.create_task(arrive(pol, workers, prompt(10, 20000)))
    await asyncio.sleep(0.01)
    t3.cancel()
    with pytest.raises(asyncio.CancelledError):
        await t3
    assert q.pending == 1 and q.gone_total == 1
    pol.release(k1)
    k4, w4 = await asyncio.wait_for(t4, 1)
    assert w4.url == k1.target[0] and q.pending == 0 and q._leaving == 0


async def test_a_request_let_go_that_fails_before_routing_passes_its_turn_on():
    pol, workers = policy(0.5, budget=1000)
    q = pol.router_queue
    k1, _ = await arrive(pol, workers, prompt(800))
    await arrive(pol, workers, prompt(800, 5000))
    t3 = asyncio.create_task(pol.prepare("/v1/completions", {"prompt": prompt(10, 9000)}, ""))
    t4 = asyncio.create_task(arrive(pol, workers, prompt(10, 20000)))
    await asyncio.sleep(0.01)
    pol.prefilled(k1)
    k3 = await asyncio.wait_for(t3, 1)
    assert k3.held and q._leaving == 1
    pol.release(k3)  # the proxy's finally: it never reached select (e.g. a bad header)
    k4, _ = await asyncio.wait_for(t4, 1)
    assert k4.target is not None and q._leaving == 0 and q.pending == 0
    assert pol.select([], RouteKey("", prompt(3))) is None  # no worker: nothing waits, nothing breaks


async def test_a_request_waits_at_most_max_wait_then_is_routed():
    pol, workers = policy(0.5, budget=1000)
    q = pol.router_queue
    q.max_wait_s = 0.05
    await arrive(pol, workers, prompt(800))
    await arrive(pol, workers, prompt(800, 5000))
    k3, w3 = await asyncio.wait_for(arrive(pol, workers, prompt(10, 9000)), 1)
    assert w3 is not None and q.expired_total == 1 and q.pending == 0 and q._leaving == 0


async def test_an_engine_snapshot_that_shows_the_queue_drained_lets_the_head_go():
    pol, workers = policy(0.5, budget=1000)
    q = pol.router_queue
    q.available = lambda: workers  # the router's registry (app.py): the targets before any decision
    el = pol.engine_loads = EngineLoads(1.0)
    now = time.monotonic()
    for w in workers:  # traffic this router never saw waits on both engines
        el.put(w.url, {0: 0}, now, waiting={0: 2000})
    t = asyncio.create_task(arrive(pol, workers, prompt(10)))
    await asyncio.sleep(0.01)
    assert q.pending == 1
    el.put(B, {0: 0}, time.monotonic(), waiting={0: 0})
    _, w = await asyncio.wait_for(t, 1)
    assert w.url == B and q.pending == 0
    q.available = lambda: []  # no worker available: nothing to wait for (the proxy answers 503)
    key = await asyncio.wait_for(pol.prepare("/v1/completions", {"prompt": prompt(5)}, ""), 1)
    assert not key.held


def test_the_budget_read_from_a_worker_is_kept_logged_and_shown_in_metrics(caplog):
    pol, _ = policy(0.5)
    q = pol.router_queue
    q.budgets.clear()
    with caplog.at_level("INFO", logger="fleetserve.router"):
        q.learned(A, {"chunked_prefill_size": 2048})
        q.learned(A, {"chunked_prefill_size": 2048})  # the same again: said once
        q.learned(B, {"model_path": "x"})  # reports none: the default, said once
        q.learned(B, {})
    assert q.budget(A) == 2048 and q.budget(B) == DEFAULT_BUDGET
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "prefill budget 2048 tokens per step: busy over 1024 queued" in lines[0]
    assert f"{B} reports no prefill budget" in lines[1] and "8192 tokens per step assumed" in lines[1]
    fam = {f.name: f for f in families(pol)}["fleetserve_router_kv_router_queue_budget_tokens"]
    assert [(s.labels["worker"], s.value) for s in fam.samples] == [(A, 2048)]
    q.forget(A)
    assert q.budget(A) == DEFAULT_BUDGET


def test_with_engine_loads_off_a_start_up_warning_says_non_streamed_requests_hold_the_queue(caplog):
    from fleetserve.router.kv_events.flags import make_kv_aware

    with caplog.at_level("WARNING", logger="fleetserve.router"):
        make_kv_aware(RouterConfig(router_queue_threshold=0.5, kv_loads_interval_secs=0))
        make_kv_aware(RouterConfig(router_queue_threshold=0.5))
    warned = [r.getMessage() for r in caplog.records if "--router-queue-threshold" in r.getMessage()]
    assert len(warned) == 1 and "non-streamed request counts as queued prefill" in warned[0]


def test_the_flag_parses_validates_and_defaults_off():
    assert RouterConfig().router_queue_threshold is None
    assert KvAwarePolicy().router_queue is None
    ns = build_parser().parse_args(["--policy", "kv_aware", "--router-queue-threshold", "0.5"])
    assert ns.router_queue_threshold == 0.5
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="--router-queue-threshold"):
            validate(RouterConfig(router_queue_threshold=bad))
