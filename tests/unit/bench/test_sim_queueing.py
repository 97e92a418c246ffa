"""The simulated engine queues as SGLang schedules: prefill first, a token budget per prefill step,
a waiting queue when slots or KV run out, prefill time growing with the uncached tokens.

Checked on the engine's own counters (steps, modelled busy time), not on wall-clock time."""

import asyncio

import pytest

from fleetserve.bench.sim_engine import SimEngine, SimRequest
from fleetserve.bench.timing_model import TimingModel

pytestmark = pytest.mark.asyncio


def req(rid: str, ids: list[int], out: int = 4) -> SimRequest:
    return SimRequest(rid=rid, input_ids=ids, max_new_tokens=out, output_ids=list(range(out)),
                      output_pieces=["x"] * out, stream_interval=1)


async def first_token(r: SimRequest) -> None:
    await asyncio.wait_for(r.events.get(), 30)


async def finish(r: SimRequest) -> None:
    while True:
        _ids, _p, done = await asyncio.wait_for(r.events.get(), 30)
        if done:
            return


async def run(model: TimingModel, reqs: list[SimRequest]) -> SimEngine:
    e = SimEngine(model)
    e.start()
    try:
        for r in reqs:
            e.submit(r)
        await asyncio.gather(*(finish(r) for r in reqs))
    finally:
        await e.stop()
    return e


def model(**kw) -> TimingModel:
    base = dict(prefill_per_token_s=1e-3, prefill_overhead_s=1e-2, decode_base_s=2e-3, decode_per_req_s=0.0,
                decode_per_ctx_token_s=0.0, max_running_requests=256, max_total_tokens=100_000,
                chunked_prefill_size=8192, time_scale=1e-3)
    base.update(kw)
    return TimingModel(**base)


async def test_prefill_time_grows_with_uncached_tokens_and_cache_hits_cut_it():
    m = model()
    # one request: one prefill step of 1000 tokens, then 3 decode steps (the first token comes with the prefill)
    e = await run(m, [req("a", list(range(1000)))])
    assert e.stats["num_prefill_steps"] == 1 and e.stats["num_decode_steps"] == 3
    assert e.stats["busy_time_s"] == pytest.approx((1e-2 + 1e-3 * 1000 + 3 * 2e-3) * 1e-3)
    # the same prompt again on the warm engine would prefill 1 token; here: a second engine, two requests one
    # after the other, the second sharing 992 tokens (62 pages of 16 at page size 16)
    m16 = model(page_size=16)
    e = SimEngine(m16)
    e.start()
    try:
        a = req("a", list(range(1000)))
        e.submit(a)
        await finish(a)
        busy_a = e.stats["busy_time_s"]
        b = req("b", list(range(1000)) + [7, 8])
        e.submit(b)
        await finish(b)
    finally:
        await e.stop()
    assert b.cached_tokens == 992  # whole pages of b's prompt minus its last token that a left in the tree
    assert e.stats["busy_time_s"] - busy_a == pytest.approx((1e-2 + 1e-3 * (1002 - 992) + 3 * 2e-3) * 1e-3)


async def test_token_budget_splits_admission_over_prefill_steps():
    # 3 prompts of 3000 distinct tokens, budget 8192: two fit the first step, the third waits for the next
    m = model(chunked_prefill_size=8192)
    reqs = [req(str(i), [i * 10_000 + t for t in range(3000)]) for i in range(3)]
    e = await run(m, reqs)
    assert e.stats["num_prefill_steps"] == 2
    # prefill first: the second prefill step runs before any decode step, so decode steps cover the
    # batches {0, 1, 2} together: 3 steps of 3 requests
    assert e.stats["num_decode_steps"] == 3


async def _queue_shape(m, reqs) -> tuple[dict, dict]:
    """Submit ``reqs`` to a sim engine of ``m``; (load at the first token, stats at the end)."""
    e = SimEngine(m)
    e.start()
    try:
        for r in reqs:
            e.submit(r)
        await first_token(reqs[0])
        load = e.load()
        await asyncio.gather(*(finish(r) for r in reqs))
    finally:
        await e.stop()
    return load, e.stats


async def test_running_slots_and_kv_make_a_waiting_queue():
    # max 2 running: the third request queues until one of them finishes
    reqs = [req(str(i), [i * 10_000 + t for t in range(100)], out=6) for i in range(3)]
    load, stats = await _queue_shape(model(max_running_requests=2), reqs)
    assert load["num_running_reqs"] == 2 and load["num_waiting_reqs"] == 1
    assert stats["num_prefill_steps"] == 2
    # KV: a pool that holds one request (prompt + output) at a time serialises them
    reqs = [req(str(i), [i * 10_000 + t for t in range(150)], out=100) for i in range(3)]
    load, e_stats = await _queue_shape(model(max_total_tokens=300), reqs)
    assert load["num_running_reqs"] == 1 and load["num_waiting_reqs"] == 2
    assert e_stats["num_prefill_steps"] == 3 and e_stats["num_decode_steps"] == 3 * 99


async def test_late_counts_the_wall_time_a_step_overran(monkeypatch):
    # every step wakes 20 ms after its modelled end (as when the CPU is starved): late_s says so
    orig = SimEngine._sleep_until

    async def slow(loop, deadline):
        await orig(loop, deadline + 0.02)

    monkeypatch.setattr(SimEngine, "_sleep_until", staticmethod(slow))
    e = await run(model(), [req("a", list(range(50)), out=3)])
    steps = e.stats["num_prefill_steps"] + e.stats["num_decode_steps"]
    assert steps == 3
    assert e.stats["late_s"] >= steps * 0.02
