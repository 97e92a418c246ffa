"""Every way a worker connection can fail ends cleanly (tests/helpers/fault_worker.py does the failing).

For each fault, on the stdlib event loop and on uvloop (the router's own), with:

* two workers (the faulty one gets the first attempt): the client gets the healthy
  worker's answer -- a retry -- whenever nothing had reached it yet;
* the faulty worker alone: a clean OpenAI-shaped 502 (``upstream_error``) or 504
  (``upstream_timeout``), never a 500 or a hang;
* a stream that had already started: with a second worker, migrated (the bad worker's
  events, then the good one's, one ``[DONE]``; see tests/unit/router/test_router_migration.py
  for the text); alone, its events, then one error event and the end of the stream, no ``[DONE]``.

After each: the in-flight gauge of every worker is back to 0, nothing is being handled,
and the router answers the next request normally.
"""

import asyncio
import json
import re

import aiohttp
import pytest
import uvloop

from helpers.fault_worker import FaultWorker

BIG = "x" * (900 << 10)  # a body the router may still be writing when reset_mid_request strikes (limit: 1 MiB)
TIMEOUT_S = 1.0

# fault -> (stream request?, what a single faulty worker's client gets)
#   ("status", code, error code) | ("events", error code) | ("ok",)
CASES = {
    "refuse": (False, ("status", 502, "upstream_error")),
    "reset_on_accept": (False, ("status", 502, "upstream_error")),
    "reset_mid_request": (False, ("status", 502, "upstream_error")),
    "reset_before_status": (False, ("status", 502, "upstream_error")),
    "close_before_status": (False, ("status", 502, "upstream_error")),
    "reset_mid_headers": (False, ("status", 502, "upstream_error")),
    "garbage": (False, ("status", 502, "upstream_error")),
    "reset_mid_body": (False, ("status", 502, "upstream_error")),
    "close_mid_body": (False, ("status", 502, "upstream_error")),
    "stall_before_status": (False, ("status", 504, "upstream_timeout")),
    "stall_mid_body": (False, ("status", 504, "upstream_timeout")),
    "reset_before_first_event": (True, ("status", 502, "upstream_error")),
    "reset_mid_stream": (True, ("events", "upstream_error")),
    "close_mid_stream": (True, ("events", "upstream_error")),
    "stall_mid_stream": (True, ("events", "upstream_timeout")),
    "reset_mid_stream/no-stream": (False, ("status", 502, "upstream_error")),
    "keepalive_reset": (False, ("ok",)),
    "close_idle": (False, ("ok",)),
    "eof_body": (False, ("ok",)),  # not a fault: a body delimited by the connection's end is complete
}


def run(loop_kind: str, coro):
    return uvloop.run(coro) if loop_kind == "uvloop" else asyncio.run(coro)


async def inflight(s: aiohttp.ClientSession, router_url: str) -> dict[str, float]:
    async with s.get(router_url + "/metrics") as r:
        text = await r.text()
    return {m[0]: float(m[1]) for m in re.findall(r'fleetserve_router_inflight_requests\{worker="([^"]+)"\} (\S+)',
                                                    text)}


async def settled(s, r) -> None:
    """Every gauge back to 0 and nothing being handled (a stream's handler ends just after its last byte)."""
    for _ in range(100):
        loads = await inflight(s, r.url)
        if r.router.handling == 0 and loads and all(v == 0 for v in loads.values()):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"in flight did not return to 0: {loads}, handling={r.router.handling}")


def events(raw: bytes) -> list:
    out = []
    for block in raw.decode().split("\n\n"):
        for line in block.split("\n"):
            if line.startswith("data: "):
                out.append(line[6:])
    return out


def body_for(fault: str, stream: bool) -> dict:
    body = {"text": "hello", "stream": stream}
    if fault == "reset_mid_request":
        body["text"] = BIG
    return body


async def scenario(InProcessRouter, fault_key: str, single: bool) -> None:
    fault = fault_key.split("/")[0]
    stream, single_expect = CASES[fault_key]
    bad = await FaultWorker("bad").start()
    good = await FaultWorker("good").start()
    urls = [bad.url] if single else [bad.url, good.url]
    cfg = dict(worker_urls=urls, policy="round_robin", request_timeout_secs=TIMEOUT_S,
               retry_initial_backoff_ms=1, retry_max_backoff_ms=5, retry_max_retries=3,
               health_check_interval_secs=3600)
    try:
        async with aiohttp.ClientSession() as s, InProcessRouter(**cfg) as r:
            if fault in ("keepalive_reset", "close_idle"):
                # a first request leaves a kept-alive connection to the bad worker in the pool
                r.router.policy._next = 0
                async with s.post(r.url + "/generate", json={"text": "prime"}) as resp:
                    assert resp.status == 200 and (await resp.json())["worker"] == "bad"
                await asyncio.sleep(0.15)  # close_idle: the worker has closed it by now
            if fault == "refuse":
                await bad.refuse()
            else:
                bad.arm(fault, times=1 if fault in ("keepalive_reset", "close_idle", "eof_body") else 100)
            r.router.policy._next = 0  # round robin: the first attempt goes to the bad worker
            async with s.post(r.url + "/generate", json=body_for(fault, stream)) as resp:
                status, ctype, raw = resp.status, resp.headers.get("Content-Type", ""), await resp.read()
            expect = single_expect if single else (
                ("migrated",) if single_expect[0] == "events" else ("ok",))
            if expect[0] == "ok":
                assert status == 200, raw[:300]
                if stream:
                    evs = events(raw)
                    assert evs[-1] == "[DONE]" and len(evs) == 4, evs
                else:
                    assert json.loads(raw)["worker"] in ("bad", "good")
                    if fault == "eof_body":
                        assert json.loads(raw) == {"worker": "bad", "text": "ok, until the end of the connection"}
                    if not single and fault not in ("keepalive_reset", "close_idle", "eof_body"):
                        assert json.loads(raw)["worker"] == "good"
                        assert r.router.stats.retries >= 1
            elif expect[0] == "status":
                assert status == expect[1], (status, raw[:300])
                err = json.loads(raw)["error"]
                assert set(err) == {"message", "type", "param", "code"} and err["code"] == expect[2], err
                assert "internal" not in err["message"]
            elif expect[0] == "migrated":  # the bad worker's events, then the good one's, one [DONE]
                assert status == 200, raw[:300]
                evs = events(raw)
                n_bad = 1 if fault == "stall_mid_stream" else 2
                assert evs[-1] == "[DONE]" and evs.count("[DONE]") == 1, evs
                assert [json.loads(e) for e in evs[:-1]] == [{"worker": "bad", "i": i} for i in range(n_bad)] + [
                    {"worker": "good", "i": i} for i in range(3)], evs
                assert r.router.stats.migrations == 1
            else:  # a stream that had started: its events, one error event, the end, no [DONE]
                assert status == 200 and ctype.startswith("text/event-stream"), (status, raw[:300])
                evs = events(raw)
                assert evs and "[DONE]" not in evs, evs
                assert json.loads(evs[0]) == {"worker": "bad", "i": 0}
                err = json.loads(evs[-1])["error"]
                assert err["code"] == expect[1] and set(err) == {"message", "type", "param", "code"}, err
            await settled(s, r)
            # the router keeps serving: once the worker behaves, a request through it succeeds
            bad.disarm()
            if fault == "refuse":
                await bad.start()  # listening again, same port
            for w in r.router.registry.workers:
                assert w.breaker.state == "closed", (w.url, w.breaker.state)
            r.router.policy._next = 0
            async with s.post(r.url + "/generate", json={"text": "after", "stream": stream}) as resp:
                assert resp.status == 200, await resp.text()
                assert (b"[DONE]" in await resp.read()) if stream else True
            await settled(s, r)
    finally:
        await bad.close()
        await good.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
@pytest.mark.parametrize("single", [False, True], ids=["two_workers", "one_worker"])
@pytest.mark.parametrize("fault_key", list(CASES))
def test_worker_fault_ends_cleanly(fault_key, single, loop_kind, InProcessRouter):
    run(loop_kind, asyncio.wait_for(scenario(InProcessRouter, fault_key, single), 30))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_reset_on_accept_is_never_a_500(loop_kind, InProcessRouter):
    """The race of a reset before the request is written, run many times (it used to answer
    ``500 internal router error: RuntimeError: unable to perform operation on <TCPTransport closed=True>``
    on uvloop, and to hang until the request timeout on the stdlib loop)."""

    async def main():
        bad = await FaultWorker("bad").start()
        try:
            async with aiohttp.ClientSession() as s, InProcessRouter(
                    worker_urls=[bad.url], request_timeout_secs=5.0, retry_max_retries=1,
                    disable_circuit_breaker=True) as r:
                seen = []
                for _ in range(30):
                    bad.arm("reset_on_accept", times=1)
                    t0 = asyncio.get_running_loop().time()
                    async with s.post(r.url + "/generate", json={"text": "x"}) as resp:
                        body = await resp.json()
                    seen.append((resp.status, body.get("error", {}).get("code"),
                                 asyncio.get_running_loop().time() - t0))
                assert all(st == 502 and code == "upstream_error" and dt < 2.0 for st, code, dt in seen), seen
                await settled(s, r)
        finally:
            await bad.close()

    run(loop_kind, asyncio.wait_for(main(), 50))


@pytest.mark.timeout(60)
def test_each_failure_and_the_breaker_opening_are_logged_naming_the_worker(InProcessRouter, caplog):
    """A worker that answers garbage fails every attempt: one warning line per failed attempt names
    the worker and what went wrong, with the running count, and one more line when the breaker
    opens (here after 2 failures); the client gets the 502 as before."""
    import logging

    async def main():
        bad = await FaultWorker("bad").start()
        try:
            async with aiohttp.ClientSession() as s, InProcessRouter(
                    worker_urls=[bad.url], request_timeout_secs=TIMEOUT_S, retry_max_retries=2,
                    retry_initial_backoff_ms=1, retry_max_backoff_ms=5, cb_failure_threshold=2,
                    health_check_interval_secs=3600) as r:
                bad.arm("garbage", times=100)
                with caplog.at_level(logging.WARNING, logger="fleetserve.router"):
                    async with s.post(r.url + "/generate", json={"text": "x"}) as resp:
                        assert resp.status in (502, 503), await resp.text()
                    await settled(s, r)
                lines = [m.getMessage() for m in caplog.records if m.name == "fleetserve.router"]
                failed = [line for line in lines if line.startswith(f"worker {bad.url} failed a request: ")]
                assert len(failed) == 2 and failed[0].endswith("(failures so far: 1)"), lines
                assert failed[1].endswith("(failures so far: 2)"), lines
                assert f"worker {bad.url}: circuit breaker open; no requests to it for 60 s" in lines, lines
                assert r.router.registry.get(bad.url).breaker.state == "open"
        finally:
            await bad.close()

    asyncio.run(asyncio.wait_for(main(), 30))
