"""A worker's 429 and 503 are back-pressure, not failure.

* They never count against the worker's circuit breaker (nor ``failures_total``).
* Another worker not asked yet takes the request at once; with none left, the client
  gets the worker's answer unchanged: status, body bytes, ``Retry-After``.
* So the moment the worker answers normally again, requests through the router succeed
  (they used to find its circuit open: 503 ``no_healthy_worker`` for ``--cb-timeout-duration-secs``).
"""

import json

import aiohttp
import pytest

from helpers.fault_worker import FaultWorker

BUSY_BODY = {429: b'{"error": {"message": "too many requests, slow down", "type": "rate_limit", "code": "busy"}}',
             503: b'{"error": {"message": "queue full", "type": "overloaded", "code": null}}'}


def arm_busy(w: FaultWorker, status: int, times: int = 1000) -> None:
    w.arm("status", times=times, status=status, body=BUSY_BODY[status], headers=[("Retry-After", "7")])


@pytest.fixture
async def workers():
    ws = [await FaultWorker(n).start() for n in ("busy", "free")]
    yield ws
    for w in ws:
        await w.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("status", [429, 503])
async def test_busy_answer_goes_to_another_worker_at_once(status, workers, InProcessRouter):
    busy, free = workers
    async with aiohttp.ClientSession() as s, InProcessRouter(worker_urls=[busy.url, free.url], policy="round_robin",
                                                             cb_failure_threshold=1) as r:
        arm_busy(busy, status)
        for _ in range(4):
            r.router.policy._next = 0  # the busy worker is asked first every time
            async with s.post(r.url + "/generate", json={"text": "hi"}) as resp:
                assert resp.status == 200 and (await resp.json())["worker"] == "free"
        w = r.router.registry.get(busy.url)
        assert (w.failures, w.breaker.state, w.breaker.failures) == (0, "closed", 0)
        assert busy.requests == 4 and free.requests == 4 and r.router.stats.retries == 4


@pytest.mark.timeout(30)
@pytest.mark.parametrize("status", [429, 503])
async def test_busy_answer_with_no_other_worker_reaches_the_client_unchanged(status, workers, InProcessRouter):
    busy, _ = workers
    async with aiohttp.ClientSession() as s, InProcessRouter(worker_urls=[busy.url]) as r:
        arm_busy(busy, status)
        chat = {"messages": [{"role": "user", "content": "x"}]}
        async with s.post(r.url + "/v1/chat/completions", json=chat) as resp:
            assert resp.status == status
            assert await resp.read() == BUSY_BODY[status]
            assert resp.headers["Retry-After"] == "7"
            assert resp.headers["Content-Type"].startswith("application/json")
        assert busy.requests == 1  # asked once: a busy worker is not asked again for the same request
        w = r.router.registry.get(busy.url)
        assert (w.failures, w.breaker.state) == (0, "closed")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("status", [429, 503])
async def test_requests_succeed_as_soon_as_the_busy_worker_has_room(status, workers, InProcessRouter):
    busy, _ = workers
    async with aiohttp.ClientSession() as s, InProcessRouter(worker_urls=[busy.url], cb_failure_threshold=2,
                                                             cb_timeout_duration_secs=600) as r:
        arm_busy(busy, status)
        for _ in range(6):
            async with s.post(r.url + "/generate", json={"text": "x"}) as resp:
                assert resp.status == status and await resp.read() == BUSY_BODY[status]
        busy.disarm()  # it has room again
        async with s.post(r.url + "/generate", json={"text": "x"}) as resp:
            assert resp.status == 200, await resp.text()
            assert (await resp.json())["worker"] == "busy"
        async with s.get(r.url + "/metrics") as resp:
            text = await resp.text()
        assert f'fleetserve_router_failures_total{{worker="{busy.url}"}} 0.0' in text
        assert f'fleetserve_router_inflight_requests{{worker="{busy.url}"}} 0.0' in text


@pytest.mark.timeout(30)
async def test_every_worker_busy_gives_the_last_answer_after_asking_each_once(workers, InProcessRouter):
    a, b = workers
    async with aiohttp.ClientSession() as s, InProcessRouter(worker_urls=[a.url, b.url], policy="round_robin") as r:
        arm_busy(a, 503)
        arm_busy(b, 429)
        r.router.policy._next = 0
        async with s.post(r.url + "/generate", json={"text": "x"}) as resp:
            assert resp.status == 429 and await resp.read() == BUSY_BODY[429]
            assert resp.headers["Retry-After"] == "7"
        assert (a.requests, b.requests) == (1, 1)


@pytest.mark.timeout(30)
async def test_a_500_is_still_a_failure_that_is_retried(workers, InProcessRouter):
    bad, free = workers
    async with aiohttp.ClientSession() as s, InProcessRouter(worker_urls=[bad.url, free.url], policy="round_robin",
                                                             retry_initial_backoff_ms=1) as r:
        bad.arm("status", times=10, status=500, body=b'{"error": "boom"}')
        r.router.policy._next = 0
        async with s.post(r.url + "/generate", json={"text": "x"}) as resp:
            assert resp.status == 200 and json.loads(await resp.read())["worker"] == "free"
        w = r.router.registry.get(bad.url)
        assert w.failures == 1 and w.breaker.failures == 1


async def test_the_healthy_gauge_agrees_with_list_workers_once_the_circuit_opens(InProcessRouter):
    """A user trial: after a worker was killed, /list_workers said is_healthy false (circuit open) while
    /metrics kept fleetserve_router_worker_healthy at 1 until the health checks (every 60 s) caught up."""
    import aiohttp

    from fleetserve.router.metrics import make_registry, render

    urls = ["http://127.0.0.1:9", "http://127.0.0.1:10"]  # never contacted: health checks off
    async with InProcessRouter(worker_urls=urls, disable_health_check=True, cb_failure_threshold=2) as r:
        reg = make_registry(r.router)

        def gauges() -> dict:
            lines = render(reg).decode().splitlines()
            return {u: next(ln.rsplit(" ", 1)[1] for ln in lines
                            if ln.startswith(f'fleetserve_router_worker_healthy{{worker="{u}"}}')) for u in urls}

        async def listed() -> dict:
            async with aiohttp.ClientSession() as s, s.get(r.url + "/list_workers") as resp:
                body = await resp.json()
            return {w["url"]: w["is_healthy"] for w in body["workers"]}

        assert gauges() == {urls[0]: "1.0", urls[1]: "1.0"} and await listed() == {urls[0]: True, urls[1]: True}
        bad = r.router.registry.get(urls[0])
        bad.record_failure("test")  # one failed attempt: not healthy until a good one, circuit still closed
        assert gauges() == {urls[0]: "0.0", urls[1]: "1.0"} and (await listed())[urls[0]] is False
        bad.record_failure("test")  # the circuit opens
        assert bad.healthy  # the health checks have not seen it: the old gauge said 1 here
        assert gauges() == {urls[0]: "0.0", urls[1]: "1.0"} and await listed() == {urls[0]: False, urls[1]: True}
