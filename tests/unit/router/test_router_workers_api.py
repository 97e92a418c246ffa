"""smg's worker REST routes (GET/POST /workers, GET/DELETE /workers/{url}) and what they and
/list_workers say about a worker whose requests fail before its health checks notice.

Shapes from smg's model gateway sources (server.rs, worker_service.rs): the list is
``{"workers", "total", "stats": {"prefill_count", "decode_count", "regular_count"}}``; a worker
has ``id``, ``url``, ``worker_type``, ``is_healthy``, ``status`` (``ready`` / ``not_ready`` /
``pending`` / ``draining``), ``load``; POST answers 202 ``{"status": "accepted", "worker_id",
"url", "location"}`` with a Location header, a registered url 409, an unknown one 404.
"""

import asyncio
from urllib.parse import quote

import aiohttp
import pytest
from aiohttp import web

T = aiohttp.ClientTimeout(total=10)


class Worker:
    """/health always 200; /generate 200, or 500 while ``failing``."""

    def __init__(self) -> None:
        self.failing = False

    def app(self) -> web.Application:
        app = web.Application()

        async def health(request):
            return web.json_response({})

        async def generate(request):
            if self.failing:
                return web.json_response({"error": {"message": "boom"}}, status=500)
            return web.json_response({"text": "ok"})

        app.router.add_get("/health", health)
        app.router.add_post("/generate", generate)
        return app


@pytest.fixture
async def workers(start_app):
    runners = []

    async def make():
        w = Worker()
        runner, url = await start_app(w.app())
        runners.append(runner)
        return w, url

    try:
        yield make
    finally:
        for runner in runners:
            await runner.cleanup()


async def call(s, method, url, **kw):
    async with s.request(method, url, timeout=T, **kw) as r:
        return r.status, await r.json(), r.headers


def path_of(url: str) -> str:
    return "/workers/" + quote(url, safe="")


@pytest.mark.timeout(60)
async def test_workers_rest_list_get_post_delete(workers, InProcessRouter):
    (_, u1), (_, u2) = await workers(), await workers()
    async with InProcessRouter(worker_urls=[u1]) as r, aiohttp.ClientSession() as s:
        st, body, _ = await call(s, "GET", r.url + "/workers")
        assert st == 200
        assert body["total"] == 1 and body["stats"] == {"prefill_count": 0, "decode_count": 0, "regular_count": 1}
        (w,) = body["workers"]
        assert (w["id"], w["url"], w["worker_type"], w["is_healthy"], w["status"], w["load"]) == (
            u1, u1, "regular", True, "ready", 0)
        # one worker by its url, percent-encoded or not
        for p in (path_of(u1), "/workers/" + u1, "/workers/" + u1[len("http://"):]):
            st, one, _ = await call(s, "GET", r.url + p)
            assert (st, one["url"], one["status"]) == (200, u1, "ready"), p
        st, err, _ = await call(s, "GET", r.url + path_of(u2))
        assert (st, err["error"]["code"]) == (404, "worker_not_found")
        st, err, _ = await call(s, "GET", r.url + "/workers/notaurl")
        assert (st, err["error"]["code"], err["error"]["param"]) == (400, "invalid_worker_url", "url")

        # POST: accepted at once, added once healthy
        st, body, h = await call(s, "POST", r.url + "/workers", json={"url": u2})
        assert st == 202 and body["status"] == "accepted" and body["worker_id"] == u2
        assert h["Location"] == body["location"] == path_of(u2)
        for _ in range(100):
            st, one, _ = await call(s, "GET", r.url + path_of(u2))
            if one["status"] == "ready":
                break
            assert one["status"] == "pending"
            await asyncio.sleep(0.05)
        assert (st, one["status"]) == (200, "ready")
        assert (await call(s, "GET", r.url + "/list_workers"))[1]["urls"] == [u1, u2]
        st, err, _ = await call(s, "POST", r.url + "/workers", json={"url": u2})
        assert (st, err["error"]["code"]) == (409, "worker_already_exists")
        for bad, param in (({"url": "notaurl"}, "url"), ({}, "url"), ({"url": u2, "api_key": 5}, "api_key"),
                           ({"url": u2, "api_key": " "}, "api_key"), ({"url": u2, "api_key": "a\nb"}, "api_key"),
                           ({"url": u2, "worker_type": "prefill"}, "worker_type")):
            st, err, _ = await call(s, "POST", r.url + "/workers", json=bad)
            assert (st, err["error"]["param"]) == (400, param), bad
        st, err, _ = await call(s, "POST", r.url + "/workers", data=b"{nope")
        assert st == 400

        # DELETE
        st, body, _ = await call(s, "DELETE", r.url + path_of(u1))
        assert (st, body["success"], body["worker_id"]) == (200, True, u1)
        assert (await call(s, "GET", r.url + path_of(u1)))[0] == 404
        assert (await call(s, "DELETE", r.url + path_of(u1)))[0] == 404
        assert [w["url"] for w in (await call(s, "GET", r.url + "/workers"))[1]["workers"]] == [u2]
        # the prefix takes only longer paths
        assert (await call(s, "GET", r.url + "/workers/"))[0] == 404


@pytest.mark.timeout(60)
async def test_a_failing_worker_shows_unhealthy_at_once_though_its_health_checks_pass(workers, InProcessRouter):
    """The health checks (every hour here) still pass, yet /list_workers and /workers show the worker
    unhealthy from its first failed request, with the breaker state and the failures in a row; a good
    request clears it.  Routing is unchanged: the next request still goes to it."""
    w, u = await workers()
    async with InProcessRouter(worker_urls=[u], health_check_interval_secs=3600, retry_max_retries=1,
                               cb_failure_threshold=2) as r, aiohttp.ClientSession() as s:
        async def shown():
            lw = (await call(s, "GET", r.url + "/list_workers"))[1]["workers"][0]
            one = (await call(s, "GET", r.url + path_of(u)))[1]
            assert {k: one[k] for k in lw} == lw
            return lw

        w.failing = True
        assert (await call(s, "POST", r.url + "/generate", json={"text": "x"}))[0] == 500
        lw = await shown()
        assert (lw["is_healthy"], lw["status"], lw["health_check"]) == (False, "not_ready", True)
        assert not {"healthy", "circuit"} & set(lw)  # each field once (smg's name where it has one)
        assert (lw["circuit_breaker"], lw["consecutive_failures"]) == ("closed", 1)
        assert (await call(s, "POST", r.url + "/generate", json={"text": "x"}))[0] == 500
        lw = await shown()
        assert (lw["is_healthy"], lw["circuit_breaker"], lw["consecutive_failures"], lw["failures"]) == (
            False, "open", 2, 2)
        # back to work: the breaker lets a trial through after its timeout; a success clears the failures
        r.router.registry.get(u).breaker.opened_at -= 3600
        w.failing = False
        assert (await call(s, "POST", r.url + "/generate", json={"text": "x"}))[0] == 200
        lw = await shown()
        assert (lw["is_healthy"], lw["status"], lw["consecutive_failures"], lw["circuit_breaker"]) == (
            True, "ready", 0, "half_open")


class HeldWorker:
    """/health 200; /generate answers only once ``release`` is set (``arrived`` is set when a request is in,
    ``transports`` its connections)."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.arrived = asyncio.Event()
        self.transports: list = []

    def app(self) -> web.Application:
        async def health(request):
            return web.json_response({})

        async def generate(request):
            self.transports.append(request.transport)
            self.arrived.set()
            await asyncio.wait_for(self.release.wait(), 20)
            return web.json_response({"text": "ok"})

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_post("/generate", generate)
        return app


async def readd(s, r, u) -> dict:
    """``DELETE`` then ``POST /workers`` ``u`` through router ``r``; its ``/workers/{url}`` once ready."""
    assert (await call(s, "DELETE", r.url + path_of(u)))[0] == 200
    assert (await call(s, "POST", r.url + "/workers", json={"url": u}))[0] == 202
    for _ in range(100):
        st, one, _ = await call(s, "GET", r.url + path_of(u))
        if st == 200 and one["status"] == "ready":
            return one
        await asyncio.sleep(0.05)
    raise AssertionError(f"{u} not ready again: {one}")


@pytest.mark.timeout(60)
async def test_a_worker_re_added_mid_request_keeps_that_request_in_its_load(start_app, InProcessRouter):
    """Removed while a request to it is in flight, then added again before that request ends: the
    re-added worker's ``load`` counts the request (1, not 0), and goes back to 0 when it ends (never
    below).  A worker removed with nothing in flight comes back as a fresh one."""
    held = HeldWorker()
    runner, u = await start_app(held.app())
    try:
        async with InProcessRouter(worker_urls=[u]) as r, aiohttp.ClientSession() as s:
            async def load():
                return (await call(s, "GET", r.url + path_of(u)))[1]["load"]

            pending = asyncio.ensure_future(call(s, "POST", r.url + "/generate", json={"text": "x"}))
            await asyncio.wait_for(held.arrived.wait(), 10)
            assert await load() == 1
            one = await readd(s, r, u)
            assert (one["status"], one["load"]) == ("ready", 1)
            held.release.set()
            st, body, _ = await pending
            assert (st, body["text"]) == (200, "ok")
            assert await load() == 0
            # nothing in flight now: removed and added again, it starts from a clean slate
            one = await readd(s, r, u)
            assert (one["status"], one["load"], one["requests"]) == ("ready", 0, 0)
    finally:
        await runner.cleanup()


@pytest.mark.timeout(60)
async def test_a_worker_back_from_being_down_shows_ready_without_a_request(start_app, InProcessRouter):
    """Its requests failed and then its health checks: down.  Once the checks find it healthy again,
    /workers shows it ready with no failures in a row, before any request reaches it (before, it stayed
    ``not_ready`` with its old failures until a request to it succeeded)."""
    state = {"up": False}

    async def health(request):
        return web.json_response({}, status=200 if state["up"] else 503)

    async def generate(request):
        return web.json_response({"error": {"message": "down"}}, status=500)

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/generate", generate)
    runner, u = await start_app(app)
    state["up"] = True
    try:
        async with InProcessRouter(worker_urls=[u], health_check_interval_secs=0.1, health_failure_threshold=1,
                                   health_success_threshold=1, retry_max_retries=1, cb_failure_threshold=100) as r, \
                aiohttp.ClientSession() as s:
            async def one():
                return (await call(s, "GET", r.url + path_of(u)))[1]

            assert (await call(s, "POST", r.url + "/generate", json={"text": "x"}))[0] == 500
            assert ((await one())["status"], (await one())["consecutive_failures"]) == ("not_ready", 1)
            state["up"] = False
            for _ in range(100):
                if (await one())["health_check"] is False:
                    break
                await asyncio.sleep(0.05)
            assert (await one())["health_check"] is False
            state["up"] = True
            for _ in range(100):
                w = await one()
                if w["health_check"]:
                    break
                await asyncio.sleep(0.05)
            assert (w["health_check"], w["status"], w["is_healthy"], w["consecutive_failures"], w["failures"]) == (
                True, "ready", True, 0, 1)
    finally:
        await runner.cleanup()


@pytest.mark.timeout(60)
async def test_a_request_in_flight_on_a_deleted_worker_finishes_there_and_its_connection_closes(
        start_app, InProcessRouter):
    """``DELETE /workers/{url}`` while a non-streamed request is in flight there: the request finishes
    on the removed worker, as a failure of nobody, and the router's connection to it is then closed
    rather than kept in its pool (the worker sees its client go away)."""
    held = HeldWorker()
    runner, u = await start_app(held.app())
    try:
        async with InProcessRouter(worker_urls=[u]) as r, aiohttp.ClientSession() as s:
            w = r.router.registry.get(u)
            pending = asyncio.ensure_future(call(s, "POST", r.url + "/generate", json={"text": "x"}))
            await asyncio.wait_for(held.arrived.wait(), 10)
            assert (await call(s, "DELETE", r.url + path_of(u)))[0] == 200
            held.release.set()
            st, body, _ = await pending
            assert (st, body["text"]) == (200, "ok")
            assert (w.load, w.failures, w.breaker.state) == (0, 0, "closed")
            for _ in range(100):
                if held.transports[0].is_closing():
                    break
                await asyncio.sleep(0.01)
            assert held.transports[0].is_closing(), "the router kept its connection to the removed worker"
    finally:
        await runner.cleanup()
