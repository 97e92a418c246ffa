"""The router as a real process in front of real (fake-LLM) worker processes."""

import asyncio
import json
import time
import os

import aiohttp
import pytest

T = aiohttp.ClientTimeout(total=20)


async def post(s, url, body, timeout=T):
    async with s.post(url, json=body, timeout=timeout) as r:
        return r.status, await r.json(content_type=None)


async def get_json(s, url):
    async with s.get(url, timeout=T) as r:
        return r.status, await r.json(content_type=None)


async def loads(s, router):
    _, body = await get_json(s, router + "/list_workers")
    return {w["url"]: w["load"] for w in body["workers"]}


async def wait_loads_zero(s, router, timeout=10.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        cur = await loads(s, router)
        if all(v == 0 for v in cur.values()) or asyncio.get_running_loop().time() > deadline:
            return cur
        await asyncio.sleep(0.05)


async def metric(s, router, name):
    async with s.get(router + "/metrics", timeout=T) as r:
        text = await r.text()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.timeout(60)
async def test_conversations_stick_to_one_worker(procs):
    urls = [procs.worker(f"w{i}")[0] for i in range(3)]
    router, _ = procs.router(urls, "--policy", "cache_aware")
    async with aiohttp.ClientSession() as s:
        homes = {}
        for turn in range(4):
            for conv in range(6):
                msgs = [{"role": "system", "content": f"Conversation {conv}: you are a terse assistant."}]
                for t in range(turn + 1):
                    msgs.append({"role": "user", "content": f"conversation {conv} question {t}: " + "x" * 40})
                    msgs.append({"role": "assistant", "content": f"answer {t}"})
                status, body = await post(s, router + "/v1/chat/completions", {"messages": msgs[:-1]})
                assert status == 200
                homes.setdefault(conv, set()).add(body["worker"])
        assert all(len(h) == 1 for h in homes.values()), homes
        # new conversations spread over the workers instead of piling on one
        assert len({next(iter(h)) for h in homes.values()}) == 3
        assert await metric(s, router, "fleetserve_router_cache_decisions_total{result=\"hit\"}") == 18
        assert await metric(s, router, "fleetserve_router_cache_decisions_total{result=\"miss\"}") == 6


@pytest.mark.timeout(60)
async def test_load_counters_return_to_zero(procs):
    urls = [procs.worker(f"w{i}")[0] for i in range(2)]
    router, _ = procs.router(urls, "--request-timeout-secs", "1", "--retry-max-retries", "2",
                             "--retry-initial-backoff-ms", "1")
    async with aiohttp.ClientSession() as s:
        # streams that finish
        for i in range(3):
            async with s.post(router + "/generate", json={"text": f"s{i}", "stream": True, "fake_chunks": 4},
                              timeout=T) as r:
                data = await r.read()
                assert r.status == 200 and data.count(b"data:") == 5
        # errors: 5xx (retried, then passed through) and 4xx (passed through)
        assert (await post(s, router + "/generate", {"text": "e", "fake_status": 500}))[0] == 500
        assert (await post(s, router + "/generate", {"text": "e", "fake_status": 422}))[0] == 422
        # timeouts (non-streaming and streaming)
        status, body = await post(s, router + "/generate", {"text": "slow", "fake_sleep": 3})
        assert status == 504 and "TimeoutError" in body["error"]["message"]
        assert body["error"]["type"] == "gateway_timeout" and body["error"]["code"] == "upstream_timeout"
        async with s.post(router + "/generate", json={"text": "slow stream", "stream": True, "fake_chunks": 10,
                                                      "fake_chunk_delay": 0.5}, timeout=T) as r:
            await r.read()  # cut short by the router's 1 s limit
        # client disconnects mid-stream and mid-request, while the load is visibly held
        r = await s.post(router + "/generate", json={"text": "drop me", "stream": True, "fake_chunks": 50,
                                                     "fake_chunk_delay": 0.05}, timeout=T)
        await r.content.readline()
        task = asyncio.create_task(post(s, router + "/generate", {"text": "cancel me", "fake_sleep": 0.8}))
        await asyncio.sleep(0.3)
        assert sum((await loads(s, router)).values()) == 2
        r.close()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    async with aiohttp.ClientSession() as s:
        assert await wait_loads_zero(s, router) == {u: 0 for u in urls}
        assert await metric(s, router, "fleetserve_router_inflight_requests") == 0


@pytest.mark.timeout(90)
async def test_worker_killed_mid_run_costs_no_request(procs):
    """SIGKILL one of three workers under load: every request still succeeds, retried elsewhere.

    Health checks are an hour apart, so only the request path can find the dead worker: round
    robin keeps sending it every third request until its circuit opens, and each of those must be
    retried on a live worker.  (Marking by the health checker is tested with --unhealthy-file.)
    """
    workers = [procs.worker(f"w{i}") for i in range(3)]
    urls = [u for u, _ in workers]
    router, _ = procs.router(urls, "--policy", "round_robin", "--health-check-interval-secs", "3600",
                             "--retry-initial-backoff-ms", "5")
    statuses, bad = [], []
    killed = asyncio.Event()

    async def client(s, k):
        after_kill, i = 0, 0
        while after_kill < 12:
            status, body = await post(s, router + "/v1/completions",
                                      {"prompt": f"client {k} request {i}", "fake_sleep": 0.01})
            statuses.append(status)
            if status != 200:
                bad.append((status, body))
            i += 1
            after_kill += killed.is_set()

    async with aiohttp.ClientSession() as s:
        load = asyncio.gather(*(client(s, k) for k in range(6)))
        await asyncio.sleep(0.3)
        procs.kill(workers[1][1])
        killed.set()
        await load
        assert bad == [] and len(statuses) >= 72
        _, lw = await get_json(s, router + "/list_workers")
        state = {w["url"]: w["circuit_breaker"] for w in lw["workers"]}
        # 72 requests after the kill: the dead worker took >= 10 first attempts (the default
        # --cb-failure-threshold), all failed, so its circuit is open and the others' closed
        assert state == {urls[0]: "closed", urls[1]: "open", urls[2]: "closed"}
        assert await metric(s, router, "fleetserve_router_retries_total") >= 10


@pytest.mark.timeout(90)
async def test_add_and_remove_workers_during_load(procs):
    (u0, _), (u1, _), (u2, _) = (procs.worker(f"w{i}") for i in range(3))
    router, _ = procs.router([u0, u1], "--policy", "round_robin")
    statuses, seen = [], []
    stop = asyncio.Event()

    async def client(s, k):
        i = 0
        while not stop.is_set():
            status, body = await post(s, router + "/generate", {"text": f"c{k} r{i}", "fake_sleep": 0.005})
            statuses.append(status)
            seen.append(body.get("worker"))
            i += 1

    async with aiohttp.ClientSession() as s:
        load = asyncio.gather(*(client(s, k) for k in range(4)))
        await asyncio.sleep(0.3)
        async with s.post(router + "/add_worker", params={"url": u2}, timeout=T) as r:
            assert r.status == 200
        await asyncio.sleep(0.5)
        async with s.post(router + "/remove_worker", params={"url": u0}, timeout=T) as r:
            assert r.status == 200
        n_at_removal = seen.count("w0")
        await asyncio.sleep(0.5)
        stop.set()
        await load
        assert set(statuses) == {200}
        assert seen.count("w2") > 0
        # at most the requests already in flight to w0 finish after its removal
        assert seen.count("w0") - n_at_removal <= 4
        _, lw = await get_json(s, router + "/list_workers")
        assert lw["urls"] == [u1, u2]
        async with s.post(router + "/remove_worker", params={"url": u0}, timeout=T) as r:
            assert r.status == 404
        async with s.post(router + "/add_worker", params={"url": u1}, timeout=T) as r:
            assert r.status == 400
        assert await wait_loads_zero(s, router) == {u1: 0, u2: 0}


@pytest.mark.timeout(60)
async def test_errors_health_and_info_endpoints(procs, tmp_path):
    flag = str(tmp_path / "unhealthy")
    (u0, _), (u1, _) = procs.worker("w0", flag), procs.worker("w1", flag)
    router, _ = procs.router([u0, u1], "--max-payload-size", "2000", "--health-check-interval-secs", "0.1",
                             "--health-failure-threshold", "1", "--health-success-threshold", "2")
    async with aiohttp.ClientSession() as s:
        async with s.post(router + "/v1/completions", data=b"{not json", timeout=T) as r:
            err = (await r.json())["error"]
            assert r.status == 400 and err["code"] == "invalid_json" and err["param"] is None  # the engine's code
        async with s.post(router + "/v1/completions", data=b"[1, 2]", timeout=T) as r:
            assert r.status == 400
        assert await metric(s, router, "fleetserve_router_bad_requests_total") == 2
        async with s.post(router + "/v1/completions", json={"prompt": "x" * 5000}, timeout=T) as r:
            assert r.status == 413 and "max-payload-size" in (await r.json())["error"]["message"]
        # a 4xx passes through unchanged and is not a worker failure
        status, body = await post(s, router + "/v1/completions", {"prompt": "p", "fake_status": 404})
        assert status == 404 and body["error"]["message"] == "fake 404"
        # a 5xx is retried on the other worker; a 5xx from both is the request's fault: not retried further,
        # no worker failure counted (proxy._forward)
        assert (await post(s, router + "/v1/completions", {"prompt": "q", "fake_status": 500}))[0] == 500
        assert await metric(s, router, "fleetserve_router_failures_total") == 0
        assert await metric(s, router, "fleetserve_router_request_faults_total") == 1
        assert await metric(s, router, "fleetserve_router_requests_total") == 3
        # a 503 is busy, not broken: each worker is asked once, and it is no failure
        assert (await post(s, router + "/v1/completions", {"prompt": "q", "fake_status": 503}))[0] == 503
        assert await metric(s, router, "fleetserve_router_failures_total") == 0
        assert await metric(s, router, "fleetserve_router_requests_total") == 5
        async with s.post(router + "/v1/completions", json={"prompt": "h"}, timeout=T) as r:
            assert r.headers["X-Fake-Worker"] in ("w0", "w1") and r.headers["Content-Length"] == str(
                len(await r.read()))
        # info endpoints and flush_cache
        status, body = await get_json(s, router + "/v1/models")
        assert status == 200 and body["data"][0]["id"] == "fake-model"
        assert (await get_json(s, router + "/get_model_info"))[1]["model_path"] == "fake-model"
        async with s.post(router + "/flush_cache", timeout=T) as r:
            assert r.status == 200
        for u in (u0, u1):
            assert (await get_json(s, u + "/stats"))[1]["flushes"] == 1
        assert (await get_json(s, router + "/readiness"))[0] == 200
        # every worker unhealthy -> 503 JSON, readiness 503; recovery after the success threshold
        open(flag, "w").close()
        await asyncio.sleep(0.6)
        status, body = await post(s, router + "/v1/completions", {"prompt": "z"})
        assert status == 503 and body["error"]["code"] == "no_healthy_worker"
        assert (await get_json(s, router + "/readiness"))[0] == 503
        assert (await get_json(s, router + "/v1/models"))[0] == 503
        os.unlink(flag)
        await asyncio.sleep(0.8)
        assert (await post(s, router + "/v1/completions", {"prompt": "z"}))[0] == 200
        assert (await get_json(s, router + "/health"))[0] == 200


@pytest.mark.timeout(60)
async def test_streaming_is_passed_through_without_buffering(procs):
    u0, _ = procs.worker("w0")
    router, _ = procs.router([u0])
    async with aiohttp.ClientSession() as s:
        loop = asyncio.get_running_loop()
        async with s.post(router + "/v1/chat/completions",
                          json={"messages": [{"role": "user", "content": "hi"}], "stream": True,
                                "fake_chunks": 4, "fake_chunk_delay": 0.3}, timeout=T) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            t0 = loop.time()
            first = await r.content.readline()
            t_first = loop.time() - t0
            rest = await r.read()
            assert r.headers["X-Fake-Worker"] == "w0"  # worker headers pass through
            assert "Connection" not in r.headers or r.headers["Connection"].lower() == "keep-alive"
        # the first event arrives long before the stream ends (4 x 0.3 s)
        assert json.loads(first[len(b"data: "):])["i"] == 0
        assert t_first < 0.25
        assert rest.count(b"data:") == 4 and rest.endswith(b"data: [DONE]\n\n")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("migrations", ["0", "1"])
async def test_worker_dying_mid_stream_ends_with_an_error_event(procs, migrations):
    """Bytes already reached the client, so no retry, and with one worker no migration: the stream
    must end with an SSE error event the client can see (not a silent cut), the worker's load must
    return to 0, and the router must keep serving.  With migration on (the default), the router
    passes whole events only, so the half event is never sent; with ``--max-migrations 0`` the
    bytes pass through as they come and the half event is closed off."""
    u0, _ = procs.worker("w0")
    router, _ = procs.router([u0], "--max-migrations", migrations)
    async with aiohttp.ClientSession() as s:
        async with s.post(router + "/v1/chat/completions",
                          json={"messages": [{"role": "user", "content": "hi"}], "stream": True,
                                "fake_chunks": 5, "fake_die_after": 2}, timeout=T) as r:
            assert r.status == 200
            body = await r.read()
        events = [e for e in body.split(b"\n\n") if e.strip()]
        assert [json.loads(e[len(b"data: "):])["i"] for e in events[:2]] == [0, 1]
        if migrations == "0":  # the half event is closed off on its own, then the error event; no [DONE]
            assert events[2] == b'data: {"worker": "cut in the mid'
            events.pop(2)
        err = json.loads(events[2][len(b"data: "):])["error"]
        assert err["code"] == "upstream_error" and err["type"] == "bad_gateway" and u0 in err["message"]
        assert len(events) == 3 and b"[DONE]" not in body
        assert await wait_loads_zero(s, router) == {u0: 0}
        st, ok = await post(s, router + "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
        assert st == 200 and ok["worker"] == "w0"


@pytest.mark.timeout(30)
async def test_router_exits_when_a_worker_never_gets_healthy(procs):
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dead = "http://127.0.0.1:9"  # discard port: nothing answers
    p = subprocess.run([sys.executable, "-m", "fleetserve.cli", "router", "--port", str(port),
                        "--host", "127.0.0.1", "--worker-urls", dead, "--worker-startup-timeout-secs", "1",
                        "--worker-startup-check-interval", "0.2"], capture_output=True, text=True, timeout=20)
    assert p.returncode == 1 and "not healthy" in p.stderr


@pytest.mark.timeout(30)
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
async def test_signal_stops_the_router_while_it_waits_for_workers(sig):
    """Waiting up to --worker-startup-timeout-secs (1800 s by default) for a worker that never
    comes up must not make the router deaf to Ctrl-C / SIGTERM."""
    import signal
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    p = subprocess.Popen([sys.executable, "-m", "fleetserve.cli", "router", "--port", str(port), "--host",
                          "127.0.0.1", "--worker-urls", "http://127.0.0.1:9", "--worker-startup-check-interval",
                          "0.2"], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 15
        line = ""
        while "waiting" not in line and time.monotonic() < deadline:
            line = p.stderr.readline()  # the router says what it waits for
        assert "waiting" in line and "http://127.0.0.1:9" in line
        p.send_signal(getattr(signal, sig))
        rc = p.wait(timeout=10)
        assert rc == 1
        assert "stopped while waiting" in p.stderr.read()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.timeout(60)
async def test_background_eviction_keeps_tree_within_budget(procs):
    urls = [procs.worker(f"w{i}")[0] for i in range(2)]
    router, _ = procs.router(urls, "--max-tree-size", "100", "--eviction-interval-secs", "0.2")
    async with aiohttp.ClientSession() as s:
        for i in range(6):
            assert (await post(s, router + "/generate", {"text": f"prompt number {i} " + "y" * 40}))[0] == 200
        assert await metric(s, router, "fleetserve_router_tree_size_chars") > 100
        await asyncio.sleep(0.6)
        assert await metric(s, router, "fleetserve_router_tree_size_chars") == 100


@pytest.mark.timeout(60)
async def test_sigterm_lets_streams_in_flight_finish(procs):
    import signal

    u0, _ = procs.worker("w0")
    router, rp = procs.router([u0], "--shutdown-grace-period-secs", "10")
    async with aiohttp.ClientSession() as s:
        async with s.post(router + "/generate", json={"text": "t", "stream": True, "fake_chunks": 6,
                                                      "fake_chunk_delay": 0.2}, timeout=T) as r:
            first = await r.content.readline()
            rp.send_signal(signal.SIGTERM)
            rest = await r.read()
        assert first.startswith(b"data:") and rest.count(b"data:") == 6 and rest.endswith(b"data: [DONE]\n\n")
    assert await asyncio.to_thread(rp.wait, 10) == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("grace,second,line", [
    ("0.5", False, "the grace period is over with 1 requests still in flight"),
    ("120", True, "a second signal came with 1 requests still in flight"),
])
async def test_a_stream_cut_at_shutdown_ends_without_done_and_the_log_says_why(procs, grace, second, line):
    """A stream of 40 x 0.1 s is cut when --shutdown-grace-period-secs ends (0.5 s), or at once by a
    second SIGTERM (with 120 s of grace): no [DONE] (the client sees an incomplete answer, never a whole
    one), the router exits 0, and the log says how many were cut and why.  (Helper trials: no line at
    all; a second signal was ignored for the whole grace period, 180 s by default.)"""
    import signal

    u0, _ = procs.worker("w0")
    router, rp = procs.router([u0], "--shutdown-grace-period-secs", grace)
    async with aiohttp.ClientSession() as s:
        async with s.post(router + "/generate", json={"text": "t", "stream": True, "fake_chunks": 40,
                                                      "fake_chunk_delay": 0.1}, timeout=T) as r:
            await r.content.readline()
            rp.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            if second:
                await asyncio.sleep(0.3)
                assert rp.poll() is None  # the first one waits for the stream
                t0 = time.monotonic()
                rp.send_signal(signal.SIGTERM)
            got = b""
            with pytest.raises(aiohttp.ClientPayloadError):
                async for chunk in r.content.iter_any():
                    got += chunk
        assert b"[DONE]" not in got
    assert await asyncio.to_thread(rp.wait, 10) == 0
    assert time.monotonic() - t0 < 2.5  # the stream had ~3.5 s to go
    rp.log.seek(0)
    assert line in rp.log.read().decode()


@pytest.mark.timeout(60)
async def test_sigterm_waits_for_a_request_to_a_worker_removed_meanwhile(procs):
    import signal

    u0, _ = procs.worker("w0")
    router, rp = procs.router([u0], "--shutdown-grace-period-secs", "10")
    async with aiohttp.ClientSession() as s:
        task = asyncio.create_task(post(s, router + "/v1/completions", {"prompt": "slow", "fake_sleep": 1.5}))
        await asyncio.sleep(0.3)
        async with s.post(router + "/remove_worker", params={"url": u0}, timeout=T) as r:
            assert r.status == 200
        rp.send_signal(signal.SIGTERM)
        status, body = await task
        assert status == 200 and body["worker"] == "w0"
    assert await asyncio.to_thread(rp.wait, 10) == 0
