"""The router's --api-key, /drain_worker, /readiness, /liveness, /health_generate and /get_loads, over real HTTP.

Golden texts and shapes are sglang-router 0.3.2's, as it answered when run
(``/readiness``: ``{"status": "not ready", "reason": "insufficient healthy
workers"}``; ``/health_generate``: its two plain-text sentences;
``/get_loads``: ``{"workers": [{"worker", "load"}]}``, -1 for a worker that
gives no load).
"""

import asyncio
import io
import time
from contextlib import redirect_stderr
from urllib.parse import quote

import aiohttp
import orjson
import pytest
from aiohttp import web

from fleetserve.router.config import parse_args

from .test_router_admission import HeldWorker, T, post, until

KEY = "router-key-1"
GOOD = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture
async def held(start_app):
    runners = []

    async def make(name="w", extra=None):
        w = HeldWorker(name)
        app = w.app()
        if extra:
            extra(app)
        runner, url = await start_app(app)
        runners.append((runner, w))
        return w, url

    try:
        yield make
    finally:
        for runner, w in runners:
            w.release_all()
            await runner.cleanup()


async def status_of(s, method, url, headers=None, **kw):
    async with s.request(method, url, headers=headers, timeout=T, **kw) as r:
        return r.status, await r.read(), r.headers


@pytest.mark.timeout(60)
async def test_api_key_guards_inference_and_admin_routes_and_leaves_probes_open(held, InProcessRouter):
    w, wurl = await held()
    w.hold = False
    async with InProcessRouter(worker_urls=[wurl], api_key=KEY) as r, aiohttp.ClientSession() as s:
        guarded = [("POST", "/generate", {"json": {"text": "x"}}), ("POST", "/v1/completions", {"json": {"prompt": "x"}}),
                   ("POST", "/v1/chat/completions", {"json": {"messages": []}}), ("GET", "/list_workers", {}),
                   ("POST", f"/add_worker?url={wurl}", {}), ("POST", f"/remove_worker?url={wurl}", {}),
                   ("POST", f"/drain_worker?url={wurl}", {}), ("POST", "/flush_cache", {}), ("GET", "/get_loads", {}),
                   ("GET", "/workers", {}), ("POST", "/workers", {"json": {"url": wurl}}),
                   ("GET", "/workers/" + quote(wurl, safe=""), {}), ("DELETE", "/workers/" + quote(wurl, safe=""), {})]
        for method, path, kw in guarded:
            for headers in (None, {"Authorization": "Bearer wrong"}, {"X-Api-Key": KEY}, {"Authorization": KEY}):
                st, body, h = await status_of(s, method, r.url + path, headers, **kw)
                assert st == 401, (path, headers)
                assert h["WWW-Authenticate"] == "Bearer"
                err = orjson.loads(body)["error"]
                assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
        assert w.arrived == []  # no refused request reached the worker
        for path in ("/health", "/liveness", "/readiness", "/health_generate", "/metrics"):
            assert (await status_of(s, "GET", r.url + path))[0] == 200, path
        # the right key goes through, and the client's header reaches the worker as it was sent
        st, body, _ = await post(s, r.url, {"text": "x", "id": 1}, GOOD)
        assert st == 200 and body["id"] == 1
        assert w.auth == [f"Bearer {KEY}"]
        assert (await status_of(s, "GET", r.url + "/list_workers", GOOD))[0] == 200
        # the auth scheme is case-insensitive (RFC 7235 2.1): any case of "Bearer" goes through, another scheme not
        for value in (f"bearer {KEY}", f"BEARER {KEY}", f"bEaReR  {KEY}"):
            assert (await status_of(s, "GET", r.url + "/list_workers", {"Authorization": value}))[0] == 200, value
        assert (await status_of(s, "GET", r.url + "/list_workers", {"Authorization": f"Basic {KEY}"}))[0] == 401
        st, body, _ = await post(s, r.url, {"text": "x", "id": 2}, {"Authorization": f"bearer {KEY}"})
        assert st == 200 and body["id"] == 2


@pytest.mark.timeout(60)
async def test_without_api_key_nothing_is_checked(held, InProcessRouter):
    w, wurl = await held()
    w.hold = False
    async with InProcessRouter(worker_urls=[wurl]) as r, aiohttp.ClientSession() as s:
        assert (await post(s, r.url, {"text": "x", "id": 1}))[0] == 200
        assert (await status_of(s, "GET", r.url + "/list_workers"))[0] == 200


@pytest.mark.timeout(60)
async def test_drain_finishes_in_flight_sends_new_requests_elsewhere_then_removes(held, InProcessRouter):
    a, aurl = await held("a")
    b, burl = await held("b")
    b.hold = False
    async with InProcessRouter(worker_urls=[aurl, burl], policy="round_robin") as r, aiohttp.ClientSession() as s:
        first = asyncio.ensure_future(post(s, r.url, {"text": "x", "id": "inflight"}))
        await until(lambda: a.arrived == ["inflight"])  # round robin starts with a
        st, body, _ = await status_of(s, "POST", r.url + f"/drain_worker?url={aurl}")
        assert st == 202
        assert orjson.loads(body)["in_flight"] == 1
        _, lw, _ = await status_of(s, "GET", r.url + "/list_workers")
        lw = orjson.loads(lw)
        assert lw["draining"] == [aurl]
        assert {x["url"]: x["draining"] for x in lw["workers"]} == {aurl: True, burl: False}
        # asked again while it drains: still 202, one drain
        assert (await status_of(s, "POST", r.url + f"/drain_worker?url={aurl}"))[0] == 202
        assert len(r.router.drains) == 1
        for i in range(4):  # new requests all go to b
            st, body, _ = await post(s, r.url, {"text": "y", "id": i})
            assert st == 200 and body["worker"] == "b"
        assert a.arrived == ["inflight"]
        a.release("inflight")
        st, body, _ = await first
        assert st == 200 and body["worker"] == "a"  # the in-flight one finished on a
        await until(lambda: r.router.registry.get(aurl) is None, timeout=5)
        _, lw, _ = await status_of(s, "GET", r.url + "/list_workers")
        lw = orjson.loads(lw)
        assert lw["urls"] == [burl] and lw["draining"] == []
        assert not r.router.drains
        assert (await status_of(s, "POST", r.url + f"/drain_worker?url={aurl}"))[0] == 404
        assert (await status_of(s, "POST", r.url + "/drain_worker?url=notaurl"))[0] == 400


@pytest.mark.timeout(60)
async def test_drain_timeout_removes_the_worker_while_its_request_still_finishes(held, InProcessRouter):
    a, aurl = await held("a")
    async with InProcessRouter(worker_urls=[aurl], drain_timeout_secs=0.3) as r, aiohttp.ClientSession() as s:
        first = asyncio.ensure_future(post(s, r.url, {"text": "x", "id": "slow"}))
        await until(lambda: a.arrived == ["slow"])
        t0 = time.monotonic()
        assert (await status_of(s, "POST", r.url + f"/drain_worker?url={aurl}"))[0] == 202
        # draining: no worker left to take a request, so readiness is 503 at once
        assert (await status_of(s, "GET", r.url + "/readiness"))[0] == 503
        await until(lambda: r.router.registry.get(aurl) is None, timeout=5)
        assert 0.25 < time.monotonic() - t0 < 3.0
        a.release("slow")
        assert (await first)[0] == 200


@pytest.mark.timeout(60)
async def test_readiness_liveness_and_health_generate(held, InProcessRouter):
    async with InProcessRouter() as r, aiohttp.ClientSession() as s:
        st, body, _ = await status_of(s, "GET", r.url + "/readiness")
        body = orjson.loads(body)
        assert st == 503 and body["status"] == "not ready" and body["reason"] == "insufficient healthy workers"
        assert body["healthy_workers"] == 0 and body["total_workers"] == 0
        st, body, h = await status_of(s, "GET", r.url + "/health_generate")
        assert st == 503 and body == b"No routers with healthy workers available"
        assert h["Content-Type"].startswith("text/plain")
        assert (await status_of(s, "GET", r.url + "/liveness"))[0] == 200
        assert (await status_of(s, "GET", r.url + "/health"))[0] == 200
    w, wurl = await held()
    async with InProcessRouter(worker_urls=[wurl]) as r, aiohttp.ClientSession() as s:
        st, body, _ = await status_of(s, "GET", r.url + "/readiness")
        body = orjson.loads(body)
        assert st == 200 and body["status"] == "ready" and body["healthy_workers"] == 1
        st, body, _ = await status_of(s, "GET", r.url + "/health_generate")
        assert st == 200 and body == b"At least one router has healthy workers"
        r.router.shutting_down = True  # what SIGTERM sets
        st, body, _ = await status_of(s, "GET", r.url + "/readiness")
        assert st == 503 and orjson.loads(body)["reason"] == "shutting down"
        assert (await status_of(s, "GET", r.url + "/liveness"))[0] == 200


@pytest.mark.timeout(60)
async def test_get_loads_reads_each_workers_get_load(held, InProcessRouter):
    seen = []

    def with_load(app):
        async def get_load(request):
            seen.append(request.headers.get("Authorization"))
            return web.json_response([{"dp_rank": 0, "num_reqs": 2, "num_waiting_reqs": 0, "num_tokens": 120},
                                      {"dp_rank": 1, "num_reqs": 1, "num_waiting_reqs": 1, "num_tokens": 30}])
        app.router.add_get("/get_load", get_load)

    _, aurl = await held("a", with_load)
    _, burl = await held("b")  # no /get_load: 404 -> -1
    async with InProcessRouter(worker_urls=[aurl, burl], api_key=KEY) as r, aiohttp.ClientSession() as s:
        st, body, _ = await status_of(s, "GET", r.url + "/get_loads", GOOD)
        assert st == 200
        assert orjson.loads(body) == {"workers": [{"worker": aurl, "load": 150},
                                                                {"worker": burl, "load": -1}]}
        assert seen == [f"Bearer {KEY}"]


def refusal(argv):
    err = io.StringIO()
    with redirect_stderr(err), pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    lines = err.getvalue().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("argv, flag", [
    (["--max-concurrent-requests", "0"], "--max-concurrent-requests"),
    (["--max-concurrent-requests", "-5"], "--max-concurrent-requests"),
    (["--max-concurrent-requests", "4", "--queue-size", "-1"], "--queue-size"),
    (["--max-concurrent-requests", "4", "--queue-timeout-secs", "0"], "--queue-timeout-secs"),
    (["--max-concurrent-requests", "4", "--rate-limit-tokens-per-second", "-1"], "--rate-limit-tokens-per-second"),
    (["--queue-size", "10"], "--queue-size"),  # a queue without a limit
    (["--queue-timeout-secs", "5"], "--queue-timeout-secs"),
    (["--rate-limit-tokens-per-second", "5"], "--rate-limit-tokens-per-second"),
    (["--api-key", " "], "--api-key"),
    (["--drain-timeout-secs", "0"], "--drain-timeout-secs"),
])
def test_bad_values_of_the_new_flags_are_refused_with_one_line_naming_the_flag(argv, flag):
    line = refusal(argv)
    assert line.startswith("fleetserve router: error: " + flag)


@pytest.mark.parametrize("argv", [["--pd-disaggregation"], ["--prefill", "http://p:1", "9000"],
                                  ["--service-discovery", "--selector", "app=x"], ["--tls-cert-path", "c.pem"],
                                  ["--log-dir", "/tmp"], ["--enable-igw"], ["--history-backend", "memory"]])
def test_sglang_router_flags_without_a_counterpart_are_refused_not_ignored(argv):
    assert refusal(argv) == f"fleetserve router: error: {argv[0]} is not supported by fleetserve router"


def test_the_new_flags_parse_with_smg_defaults():
    c = parse_args([])
    assert c.max_concurrent_requests == -1 and c.api_key is None
    assert c.effective_queue_size == 100 and c.effective_queue_timeout_secs == 60.0
    c = parse_args(["--max-concurrent-requests", "8", "--queue-size", "0", "--queue-timeout-secs", "2.5",
                    "--rate-limit-tokens-per-second", "0", "--api-key", "k", "--drain-timeout-secs", "9"])
    assert (c.max_concurrent_requests, c.effective_queue_size, c.effective_queue_timeout_secs,
            c.rate_limit_tokens_per_second, c.api_key, c.drain_timeout_secs) == (8, 0, 2.5, 0.0, "k", 9.0)
