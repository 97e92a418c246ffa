"""The real router process (uvloop, flags from the command line): worker faults, busy workers, sticky sessions."""

import asyncio
import hashlib
import threading

import aiohttp
import pytest

from helpers.fault_worker import FaultWorker

T = aiohttp.ClientTimeout(total=20)


class ThreadedWorker:
    """A :class:`FaultWorker` on its own event loop in a thread, so the test's loop may block."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.w = asyncio.run_coroutine_threadsafe(FaultWorker(name).start(), self.loop).result(10)

    def arm(self, *args, **kw) -> None:
        self.loop.call_soon_threadsafe(lambda: self.w.arm(*args, **kw))

    def disarm(self) -> None:
        self.loop.call_soon_threadsafe(self.w.disarm)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.w.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def two_fault_workers():
    ws = [ThreadedWorker(n) for n in ("bad", "good")]
    yield ws
    for w in ws:
        w.close()


@pytest.mark.timeout(120)
async def test_resets_and_busy_answers_through_the_real_router(procs, two_fault_workers):
    bad, good = two_fault_workers
    router, _ = procs.router([bad.w.url, good.w.url], "--policy", "round_robin", "--retry-initial-backoff-ms", "1",
                             "--cb-failure-threshold", "3")
    async with aiohttp.ClientSession(timeout=T) as s:
        # busy answers: retried on the other worker at once, and no circuit-breaker failure
        bad.arm("status", times=1000, status=429, body=b'{"error": "busy"}', headers=[("Retry-After", "3")])
        for _ in range(10):  # round robin: every other request asks the busy worker first (5 > threshold 3)
            async with s.post(router + "/generate", json={"text": "busy"}) as r:
                assert r.status == 200 and (await r.json())["worker"] == "good"
        bad.disarm()  # it has room again: it gets traffic at once
        seen = set()
        for _ in range(4):
            async with s.post(router + "/generate", json={"text": "fine"}) as r:
                assert r.status == 200
                seen.add((await r.json())["worker"])
        assert seen == {"bad", "good"}
    # connection faults, on a router whose pool holds no connection to the bad worker yet
    router, _ = procs.router([bad.w.url, good.w.url], "--policy", "round_robin", "--retry-initial-backoff-ms", "1",
                             "--disable-circuit-breaker")
    async with aiohttp.ClientSession(timeout=T) as s:
        for fault in ("reset_on_accept", "reset_before_status", "reset_mid_body"):
            bad.arm(fault, times=1000)
            for _ in range(6):  # round robin: every other request is tried on the bad worker first
                async with s.post(router + "/generate", json={"text": fault}) as r:
                    assert r.status == 200, await r.text()
                    assert (await r.json())["worker"] == "good"
            async with s.get(router + "/metrics") as r:
                text = await r.text()
            assert f'fleetserve_router_inflight_requests{{worker="{bad.w.url}"}} 0.0' in text


@pytest.mark.timeout(120)
async def test_sticky_sessions_flags_through_the_real_router(procs):
    urls = [procs.worker(f"w{i}")[0] for i in range(3)]
    router, _ = procs.router(urls, "--sticky-sessions", "--routing-key-headers", "X-Session-ID",
                             "--max-idle-secs", "600", "--sticky-max-sessions", "1000")
    async with aiohttp.ClientSession(timeout=T) as s:
        workers = {}
        for session in ("alpha", "bravo", "charlie"):
            for i in range(10):
                async with s.post(router + "/v1/completions", headers={"X-Session-ID": session},
                                  json={"prompt": hashlib.sha256(f"{session}{i}".encode()).hexdigest()}) as r:
                    assert r.status == 200
                    workers.setdefault(session, set()).add(r.headers["X-Fake-Worker"])
        assert all(len(v) == 1 for v in workers.values()), workers
        assert len(set.union(*workers.values())) >= 2, workers
        async with s.get(router + "/metrics") as r:
            assert "fleetserve_router_sticky_sessions 3.0" in await r.text()
