"""Admission control and --api-key through the real ``fleetserve router`` process and fake-LLM worker processes."""

import asyncio

import aiohttp
import pytest

T = aiohttp.ClientTimeout(total=30)
KEY = "e2e-key"
GOOD = {"Authorization": f"Bearer {KEY}"}


async def metric(s, router, name):
    async with s.get(router + "/metrics", timeout=T) as r:
        text = await r.text()
    for line in text.splitlines():
        if line and not line.startswith("#") and line.rsplit(" ", 1)[0] == name:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(name)


@pytest.mark.timeout(90)
async def test_limit_queue_429_and_key_through_the_cli(procs):
    url, _ = procs.worker("w0")
    router, _ = procs.router([url], "--max-concurrent-requests", "2", "--rate-limit-tokens-per-second", "0",
                             "--queue-size", "1", "--queue-timeout-secs", "30", "--api-key", KEY)
    async with aiohttp.ClientSession() as s:
        async with s.post(router + "/generate", json={"text": "x"}, timeout=T) as r:
            assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_api_key"

        async def one(i):
            async with s.post(router + "/generate", json={"text": f"r{i}", "fake_sleep": 1.5}, headers=GOOD,
                              timeout=T) as r:
                return r.status, r.headers.get("Retry-After"), asyncio.get_running_loop().time()

        t0 = asyncio.get_running_loop().time()
        tasks = []
        for i in range(4):
            tasks.append(asyncio.ensure_future(one(i)))
            await asyncio.sleep(0.15)  # arrive in order
        results = await asyncio.gather(*tasks)
        statuses = sorted(st for st, _, _ in results)
        assert statuses == [200, 200, 200, 429]
        rejected = [r for r in results if r[0] == 429][0]
        assert rejected[1] == "1" and rejected[2] - t0 < 1.2  # answered at once, not after a wait
        # the queued one ran after one of the first two finished: about 2 x 1.5 s
        assert max(t for st, _, t in results if st == 200) - t0 > 2.5
        assert await metric(s, router, "fleetserve_router_queue_length") == 0
        assert await metric(s, router, "fleetserve_router_admitted_requests") == 0
        assert await metric(s, router, 'fleetserve_router_rejections_total{reason="queue_full"}') == 1
        async with s.get(router + "/readiness", timeout=T) as r:
            assert r.status == 200 and (await r.json())["status"] == "ready"


@pytest.mark.timeout(90)
async def test_readiness_is_503_once_sigterm_arrives_while_requests_finish(procs):
    import os
    import signal

    url, _ = procs.worker("w0")
    router, rp = procs.router([url])
    conn = aiohttp.TCPConnector(limit=1)  # one keep-alive connection, opened before the signal
    async with aiohttp.ClientSession(connector=conn) as s, aiohttp.ClientSession() as s2:
        async with s.get(router + "/readiness", timeout=T) as r:
            assert r.status == 200
        slow = asyncio.ensure_future(s2.post(router + "/generate", json={"text": "x", "fake_sleep": 2.0}, timeout=T))
        await asyncio.sleep(0.5)
        os.kill(rp.pid, signal.SIGTERM)
        await asyncio.sleep(0.3)
        async with s.get(router + "/readiness", timeout=T) as r:  # on the connection that stays open
            body = await r.json()
            assert r.status == 503 and body["reason"] == "shutting down"
        async with s.get(router + "/liveness", timeout=T) as r:
            assert r.status == 200
        resp = await slow
        assert resp.status == 200  # the request in flight still finished
        resp.release()
    assert rp.wait(timeout=10) == 0
