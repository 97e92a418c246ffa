"""A simulated engine whose step raises stops as a crashed scheduler does, loudly: every request it
held ends with an error, new ones are refused, and its worker answers 503 ``engine_unavailable``
(``/health`` included) instead of hanging. The fault is injected: a radix-cache insert that raises."""

import asyncio
import contextlib
import json
import socket

import aiohttp
import pytest
from aiohttp import web

from fleetserve.bench.sim_engine import SimEngine, SimEngineError, SimRequest
from fleetserve.bench.sim_tokenizer import make_tokenizer
from fleetserve.bench.sim_worker import SimWorker
from fleetserve.bench.timing_model import TimingModel

pytestmark = pytest.mark.asyncio


def model() -> TimingModel:
    return TimingModel(prefill_per_token_s=1e-4, prefill_overhead_s=0.0, decode_base_s=1e-3, decode_per_req_s=0.0,
                       decode_per_ctx_token_s=0.0, max_running_requests=8, max_total_tokens=10_000,
                       chunked_prefill_size=8192, time_scale=1.0)


def req(rid: str, ids: list[int], out: int = 4) -> SimRequest:
    return SimRequest(rid=rid, input_ids=ids, max_new_tokens=out, output_ids=list(range(out)),
                      output_pieces=["x"] * out, stream_interval=1)


def break_inserts(engine: SimEngine, after: int = 0) -> None:
    """Make the engine's radix-cache insert raise from its ``after + 1``-th call on."""
    real, calls = engine.cache.insert, [0]

    def insert(*a, **kw):
        calls[0] += 1
        if calls[0] > after:
            raise RuntimeError("injected insert failure")
        return real(*a, **kw)
    engine.cache.insert = insert


@pytest.mark.timeout(30)
async def test_a_failing_step_ends_every_held_request_and_refuses_new_ones():
    e = SimEngine(model(), name="w0")
    break_inserts(e, after=1)  # the first prompt enters the tree; its release (the 2nd insert) raises
    e.start()
    try:
        first = req("a", [1, 2, 3, 4], out=3)
        e.submit(first)
        ids, _p, done = await asyncio.wait_for(first.events.get(), 10)
        assert ids == [0] and not done and first.error is None
        second, third = req("b", [9, 8, 7], out=50), req("c", [9, 8, 6], out=50)
        e.submit(second)
        e.submit(third)
        for r in (first, second, third):
            while True:  # every request gets a last, finishing event (none hangs)
                _ids, _p, done = await asyncio.wait_for(r.events.get(), 10)
                if done:
                    break
            assert r.finished and r.error == "RuntimeError: injected insert failure"
        assert e.error == "RuntimeError: injected insert failure"
        assert not e.waiting and not e.running and not e.prefilling
        with pytest.raises(SimEngineError, match="'w0' stopped: RuntimeError: injected insert failure"):
            e.submit(req("d", [1, 2]))
    finally:
        await e.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.asynccontextmanager
async def served(e: SimEngine):
    """A SimWorker around ``e`` on a free port, ``e`` started; yields its base URL; stops both on exit."""
    port = free_port()
    worker = SimWorker(e, make_tokenizer("word"), "sim-model", 1, f"http://127.0.0.1:{port}")
    runner = web.AppRunner(worker.app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    e.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await e.stop()
        await runner.cleanup()


@pytest.mark.timeout(30)
async def test_the_worker_answers_503_engine_unavailable_once_its_engine_failed():
    e = SimEngine(model(), name="w0")
    async with served(e) as base:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
            async with s.post(base + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2}) as r:
                assert r.status == 200  # a healthy engine first
            break_inserts(e)
            # streamed: the chunks so far, then the engine's error event and no [DONE]
            async with s.post(base + "/v1/chat/completions",
                              json={"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 20,
                                    "stream": True}) as r:
                assert r.status == 200
                events = [line[6:] for line in (await r.text()).splitlines() if line.startswith("data: ")]
            assert "[DONE]" not in events
            last = json.loads(events[-1])["error"]
            assert last["code"] == "engine_unavailable" and "injected insert failure" in last["message"]
            # not streamed, and /health: 503 with the engine's body
            for method, path, body in (("POST", "/generate", {"input_ids": [1, 2], "sampling_params": {}}),
                                       ("POST", "/v1/completions", {"prompt": "a b", "max_tokens": 2}),
                                       ("GET", "/health", None)):
                async with s.request(method, base + path, json=body) as r:
                    assert r.status == 503, path
                    err = (await r.json())["error"]
                assert err["code"] == "engine_unavailable" and "injected insert failure" in err["message"], path


@pytest.mark.timeout(30)
async def test_a_request_over_the_kv_capacity_gets_context_length_exceeded():
    e = SimEngine(model(), name="w0")
    async with served(e) as base:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
            async with s.post(base + "/v1/completions",
                              json={"prompt": [1, 2, 3], "max_tokens": 20_000}) as r:
                assert r.status == 400
                err = (await r.json())["error"]
        assert err["code"] == "context_length_exceeded" and "exceeds the KV capacity (10000 tokens)" in err["message"]
