"""A 5xx that two workers both answer is the request's fault, not theirs.

A body that crashes every engine alike (helper trial: a chat message with ``content: null`` made the
sim-worker answer 500) used to be retried on every worker and counted against each one, so five such
requests opened every circuit breaker and took the fleet down for the breaker's timeout.  Now the first
worker's 5xx waits: a second worker answering the same request with a 5xx too settles it as the
request's fault (no further retry, neither worker's failure counted, the client gets the answer); the
first worker's failure is counted when the request ends any other way (an answer elsewhere, no other
worker, retries used up)."""

import aiohttp
import pytest

from helpers.fault_worker import FaultWorker

CRASH = b'{"error": {"message": "engine crashed on this body", "type": "internal_server_error", "code": null}}'


def arm_crash(w: FaultWorker, times: int = 1000) -> None:
    w.arm("status", times=times, status=500, body=CRASH)


@pytest.fixture
async def workers():
    ws = [await FaultWorker(n).start() for n in ("w0", "w1", "w2")]
    yield ws
    for w in ws:
        await w.close()


def failures(r, ws) -> list:
    return [(r.router.registry.get(w.url).failures, r.router.registry.get(w.url).breaker.state) for w in ws]


@pytest.mark.timeout(30)
async def test_a_body_every_worker_fails_on_is_answered_without_opening_any_breaker(workers, InProcessRouter):
    async with aiohttp.ClientSession() as s, InProcessRouter(
            worker_urls=[w.url for w in workers], policy="round_robin", cb_failure_threshold=2,
            retry_initial_backoff_ms=1, retry_max_backoff_ms=2) as r:
        for w in workers:
            arm_crash(w)
        for _ in range(6):
            async with s.post(r.url + "/generate", json={"text": "poison"}) as resp:
                assert resp.status == 500
                assert await resp.read() == CRASH
        assert failures(r, workers) == [(0, "closed")] * 3
        stats = r.router.stats
        assert (stats.request_faults, stats.retries) == (6, 6)  # one retry each, then settled
        assert sum(w.requests for w in workers) == 12
        async with s.get(r.url + "/metrics") as resp:
            assert "fleetserve_router_request_faults_total 6.0" in await resp.text()
        for w in workers:
            w.disarm()
        for _ in range(3):  # every worker still takes traffic
            async with s.post(r.url + "/generate", json={"text": "fine"}) as resp:
                assert resp.status == 200


@pytest.mark.timeout(30)
async def test_a_worker_that_fails_where_another_answers_is_counted(workers, InProcessRouter):
    bad, good, _ = workers
    async with aiohttp.ClientSession() as s, InProcessRouter(
            worker_urls=[bad.url, good.url], policy="round_robin", cb_failure_threshold=3,
            retry_initial_backoff_ms=1, retry_max_backoff_ms=2) as r:
        arm_crash(bad)
        for i in range(3):
            r.router.policy._next = 0  # the failing worker is asked first every time
            async with s.post(r.url + "/generate", json={"text": "fine"}) as resp:
                assert resp.status == 200 and (await resp.json())["worker"] == "w1"
            assert failures(r, [bad])[0][0] == i + 1
        assert failures(r, [bad, good]) == [(3, "open"), (0, "closed")]
        assert r.router.stats.request_faults == 0


@pytest.mark.timeout(30)
async def test_with_one_worker_every_5xx_is_its_failure(workers, InProcessRouter):
    only = workers[0]
    async with aiohttp.ClientSession() as s, InProcessRouter(
            worker_urls=[only.url], cb_failure_threshold=100, retry_max_retries=3,
            retry_initial_backoff_ms=1, retry_max_backoff_ms=2) as r:
        arm_crash(only)
        async with s.post(r.url + "/generate", json={"text": "x"}) as resp:
            assert resp.status == 500 and await resp.read() == CRASH
        assert failures(r, [only]) == [(3, "closed")]  # nothing else answered: each attempt counts
        assert r.router.stats.request_faults == 0
