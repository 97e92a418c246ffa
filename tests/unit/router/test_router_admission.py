"""Admission control over real HTTP: a router in this event loop in front of in-process aiohttp workers.

The workers hold each request until the test lets it go (an ``asyncio.Event``
per request), so what runs, what waits and in which order is decided by the
test, not by timing.
"""

import asyncio
import time

import aiohttp
import pytest
from aiohttp import web

from fleetserve.router.admission import Admission

T = aiohttp.ClientTimeout(total=30)


class HeldWorker:
    """An aiohttp worker: each request records its ``id`` on arrival and waits for ``release(id)``."""

    def __init__(self, name: str = "w") -> None:
        self.name = name
        self.arrived: list = []  # request ids in arrival order
        self.arrival_times: list[float] = []
        self.gates: dict = {}
        self.auth: list = []
        self.hold = True

    def gate(self, rid) -> asyncio.Event:
        return self.gates.setdefault(rid, asyncio.Event())

    def release(self, rid) -> None:
        self.gate(rid).set()

    def release_all(self) -> None:
        self.hold = False
        for g in self.gates.values():
            g.set()

    def app(self) -> web.Application:
        async def infer(request: web.Request) -> web.Response:
            body = await request.json()
            rid = body.get("id")
            self.arrived.append(rid)
            self.arrival_times.append(time.monotonic())
            self.auth.append(request.headers.get("Authorization"))
            if self.hold:
                await self.gate(rid).wait()
            return web.json_response({"worker": self.name, "id": rid})

        async def health(request: web.Request) -> web.Response:
            return web.json_response({"ok": True})

        app = web.Application()
        for p in ("/generate", "/v1/completions", "/v1/chat/completions"):
            app.router.add_post(p, infer)
        app.router.add_get("/health", health)
        return app


@pytest.fixture
async def held(start_app):
    runners = []

    async def make(name="w"):
        w = HeldWorker(name)
        runner, url = await start_app(w.app())
        runners.append((runner, w))
        return w, url

    try:
        yield make
    finally:
        for runner, w in runners:
            w.release_all()
            await runner.cleanup()


async def metric(s, router, name):
    """The value of the sample ``name`` (labels included, as Prometheus prints them) on ``/metrics``."""
    async with s.get(router + "/metrics", timeout=T) as r:
        text = await r.text()
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            if key == name:
                return float(value)
    raise AssertionError(f"{name} not in /metrics")


async def until(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        await asyncio.sleep(0.01)


async def post(s, url, body, headers=None):
    async with s.post(url + "/generate", json=body, headers=headers, timeout=T) as r:
        return r.status, await r.json(content_type=None), r.headers


@pytest.mark.timeout(60)
async def test_limit_2_with_6_clients_two_run_four_wait_and_go_in_order(held, InProcessRouter):
    w, wurl = await held()
    async with InProcessRouter(worker_urls=[wurl], max_concurrent_requests=2, rate_limit_tokens_per_second=0,
                               queue_size=10) as r, aiohttp.ClientSession() as s:
        adm = r.router.admission
        tasks = []
        for i in range(6):  # one after the other, so their arrival order at the router is known
            tasks.append(asyncio.ensure_future(post(s, r.url, {"text": f"t{i}", "id": i})))
            await until(lambda: len(w.arrived) + adm.queued == i + 1)
        assert w.arrived == [0, 1]
        assert adm.queued == 4 and adm.admitted == 2
        assert await metric(s, r.url, "fleetserve_router_queue_length") == 4
        assert await metric(s, r.url, "fleetserve_router_admitted_requests") == 2
        for i in range(6):  # each finished request admits exactly the next one in line
            w.release(i)
            await until(lambda: len(w.arrived) == min(6, i + 3) and adm.queued == max(0, 6 - (i + 3)))
            assert w.arrived == list(range(min(6, i + 3)))
        results = await asyncio.gather(*tasks)
        assert [(st, b["id"]) for st, b, _ in results] == [(200, i) for i in range(6)]
        # every gauge back to zero
        assert adm.queued == 0 and adm.admitted == 0 and r.router.inflight() == 0
        assert await metric(s, r.url, "fleetserve_router_queue_length") == 0
        assert await metric(s, r.url, "fleetserve_router_admitted_requests") == 0
        assert await metric(s, r.url, f'fleetserve_router_inflight_requests{{worker="{wurl}"}}') == 0
        assert await metric(s, r.url, "fleetserve_router_queue_wait_seconds_count") == 6
        assert await metric(s, r.url, 'fleetserve_router_rate_limit_total{result="allowed"}') == 6


@pytest.mark.timeout(60)
async def test_a_full_queue_answers_429_with_retry_after_at_once(held, InProcessRouter):
    w, wurl = await held()
    async with InProcessRouter(worker_urls=[wurl], max_concurrent_requests=1, rate_limit_tokens_per_second=0,
                               queue_size=1) as r, aiohttp.ClientSession() as s:
        running = asyncio.ensure_future(post(s, r.url, {"text": "a", "id": "a"}))
        await until(lambda: w.arrived == ["a"])
        queued = asyncio.ensure_future(post(s, r.url, {"text": "b", "id": "b"}))
        await until(lambda: r.router.admission.queued == 1)
        t0 = time.monotonic()
        status, body, headers = await post(s, r.url, {"text": "c", "id": "c"})
        assert time.monotonic() - t0 < 1.0
        assert status == 429
        assert headers["Retry-After"] == "1"
        assert body["error"]["type"] == "rate_limit_error"
        assert body["error"]["code"] == "rate_limit_exceeded"
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert await metric(s, r.url, 'fleetserve_router_rejections_total{reason="queue_full"}') == 1
        w.release_all()
        assert (await running)[0] == 200 and (await queued)[0] == 200
        assert "c" not in w.arrived


@pytest.mark.timeout(60)
async def test_queue_size_0_means_429_at_once_and_retry_after_follows_the_refill_rate(held, InProcessRouter):
    w, wurl = await held()
    async with InProcessRouter(worker_urls=[wurl], max_concurrent_requests=1, rate_limit_tokens_per_second=0.5,
                               queue_size=0) as r, aiohttp.ClientSession() as s:
        running = asyncio.ensure_future(post(s, r.url, {"text": "a", "id": "a"}))
        await until(lambda: w.arrived == ["a"])
        status, body, headers = await post(s, r.url, {"text": "b", "id": "b"})
        assert status == 429 and headers["Retry-After"] == "2"  # ceil(1 / 0.5 tokens/s)
        w.release_all()
        assert (await running)[0] == 200


@pytest.mark.timeout(60)
async def test_a_request_that_waited_past_the_timeout_gets_408(held, InProcessRouter):
    w, wurl = await held()
    async with InProcessRouter(worker_urls=[wurl], max_concurrent_requests=1, rate_limit_tokens_per_second=0,
                               queue_timeout_secs=0.3) as r, aiohttp.ClientSession() as s:
        running = asyncio.ensure_future(post(s, r.url, {"text": "a", "id": "a"}))
        await until(lambda: w.arrived == ["a"])
        t0 = time.monotonic()
        status, body, _ = await post(s, r.url, {"text": "b", "id": "b"})
        took = time.monotonic() - t0
        assert status == 408 and 0.25 < took < 2.0
        assert body["error"]["code"] == "queue_timeout" and body["error"]["type"] == "timeout_error"
        assert r.router.admission.queued == 0
        assert await metric(s, r.url, 'fleetserve_router_rejections_total{reason="queue_timeout"}') == 1
        w.release_all()
        assert (await running)[0] == 200
        assert w.arrived == ["a"]


@pytest.mark.timeout(60)
async def test_a_queued_client_that_disconnects_leaves_at_once_and_never_reaches_a_worker(held, InProcessRouter):
    w, wurl = await held()
    async with InProcessRouter(worker_urls=[wurl], max_concurrent_requests=1,
                               rate_limit_tokens_per_second=0) as r, aiohttp.ClientSession() as s:
        adm = r.router.admission
        running = asyncio.ensure_future(post(s, r.url, {"text": "a", "id": "a"}))
        await until(lambda: w.arrived == ["a"])
        async with aiohttp.ClientSession() as gone_s:  # its own connection, closed with the session
            gone = asyncio.ensure_future(post(gone_s, r.url, {"text": "gone", "id": "gone"}))
            await until(lambda: adm.queued == 1)
            after = asyncio.ensure_future(post(s, r.url, {"text": "after", "id": "after"}))
            await until(lambda: adm.queued == 2)
            gone.cancel()
        await until(lambda: adm.queued == 1, timeout=2.0)  # left the queue on the disconnect itself
        assert await metric(s, r.url, 'fleetserve_router_rejections_total{reason="client_disconnected"}') == 1
        w.release_all()
        assert (await running)[0] == 200
        assert (await after)[1]["id"] == "after"
        assert w.arrived == ["a", "after"]
        assert adm.admitted == 0 and adm.queued == 0 and r.router.inflight() == 0


@pytest.mark.timeout(60)
async def test_the_refill_rate_holds_within_20_percent(held, InProcessRouter):
    """Capacity 2, 10 tokens/s, every request held by the worker: after the burst of 2, requests
    reach the worker at 10/s (tokens only come from the refill, since none is given back)."""
    w, wurl = await held()
    async with InProcessRouter(worker_urls=[wurl], max_concurrent_requests=2, rate_limit_tokens_per_second=10,
                               queue_size=100) as r, aiohttp.ClientSession(
                                   connector=aiohttp.TCPConnector(limit=0)) as s:
        tasks = [asyncio.ensure_future(post(s, r.url, {"text": f"t{i}", "id": i})) for i in range(40)]
        await until(lambda: len(w.arrived) >= 32, timeout=20)
        times = w.arrival_times
        # the burst: the first two at once
        assert times[1] - times[0] < 0.2
        span = times[31] - times[2]  # 29 refill intervals
        rate = 29 / span
        assert 8.0 <= rate <= 12.0, rate
        w.release_all()
        results = await asyncio.gather(*tasks)
        assert all(st == 200 for st, _, _ in results)
        assert r.router.admission.admitted == 0 and r.router.admission.queued == 0


@pytest.mark.timeout(30)
async def test_tokens_come_back_when_a_request_ends_and_the_queue_is_fifo():
    """The bucket itself: capacity 1, no refill; waiters are served head first; a waiter cancelled
    right after it was handed a token gives that token to the next one."""
    a = Admission(1, 0, queue_size=5, queue_timeout_s=10)
    assert await a.admit() is None and a.admitted == 1 and a.tokens == 0
    order = []

    async def waiter(name):
        assert await a.admit() is None
        order.append(name)

    t1 = asyncio.ensure_future(waiter("first"))
    t2 = asyncio.ensure_future(waiter("second"))
    await asyncio.sleep(0.01)
    assert a.queued == 2
    a.release()  # token handed to "first" ...
    t1.cancel()  # ... which goes away before it runs: the token must pass to "second"
    await asyncio.gather(t1, return_exceptions=True)
    await asyncio.wait_for(t2, 2)
    assert order == ["second"] and a.admitted == 1 and a.queued == 0
    a.release()
    assert a.admitted == 0 and a.tokens == 1.0


@pytest.mark.timeout(30)
async def test_a_new_arrival_never_overtakes_a_waiter_and_the_refill_timer_admits_it():
    a = Admission(1, 20, queue_size=5, queue_timeout_s=10)  # one token per 50 ms
    assert a.try_admit() and a.tokens < 1
    waiter = asyncio.ensure_future(a.admit())
    await asyncio.sleep(0)
    assert a.queued == 1
    a.tokens = 1.0  # a token is there before the refill timer fired: it belongs to the waiter
    assert a.try_admit() is False
    assert await asyncio.wait_for(waiter, 2) is None  # the timer hands it over
    assert a.admitted == 2 and a.queued == 0
