"""POST /add_worker: a bad url is refused at once; a worker not up yet does not hold the call."""

import asyncio
import logging
import socket
import time

import aiohttp
import pytest
from aiohttp import web

from fleetserve.router import admin
from fleetserve.router.workers import normalize_url


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health_app() -> web.Application:
    app = web.Application()

    async def ok(request):
        return web.json_response({"ok": True})

    app.router.add_get("/health", ok)
    return app


async def start_on(port: int) -> web.AppRunner:
    runner = web.AppRunner(health_app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


async def add(s, router_url, url):
    t0 = time.monotonic()
    async with s.post(router_url + "/add_worker", params={"url": url}) as r:
        return r.status, await r.json(), time.monotonic() - t0


async def listed(s, router_url):
    async with s.get(router_url + "/list_workers") as r:
        return await r.json()


@pytest.mark.parametrize("bad", ["notaurl", "not a url", "http://h:99999", "https://h:1", "http://h:1/v1", ""])
@pytest.mark.timeout(30)
async def test_a_bad_url_is_a_400_at_once_naming_the_param(bad, InProcessRouter):
    async with InProcessRouter(worker_startup_timeout_secs=60) as r, aiohttp.ClientSession() as s:
        status, body, took = await add(s, r.url, bad)
        assert status == 400
        assert body["error"]["param"] == "url"
        assert body["error"]["type"] == "invalid_request_error"
        assert ("bad worker url" in body["error"]["message"]) or ("missing ?url=" in body["error"]["message"])
        assert took < 1.0
        assert await listed(s, r.url) == {"urls": [], "workers": [], "pending": [], "draining": []}


def test_worker_urls_flag_refuses_a_bare_name_too(capsys):
    from fleetserve.router.config import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--worker-urls", "notaurl"])
    assert "'notaurl' is not a worker URL: give http://host:port or host:port" in capsys.readouterr().err
    assert normalize_url("notaurl:8000") == "http://notaurl:8000"


@pytest.mark.timeout(30)
async def test_a_worker_not_up_yet_answers_202_pending_then_is_added_once_healthy(monkeypatch, caplog, InProcessRouter):
    monkeypatch.setattr(admin, "ADD_WORKER_ANSWER_WITHIN_S", 0.3)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    caplog.set_level(logging.INFO, logger="fleetserve.router")
    async with InProcessRouter(worker_startup_timeout_secs=60) as r, aiohttp.ClientSession() as s:
        status, body, took = await add(s, r.url, url)
        assert status == 202
        assert body["status"] == "pending" and body["success"] is True
        assert took < 2.0
        assert f"worker {url}: waiting up to 60 s for its health check (/health)" in caplog.text
        assert await listed(s, r.url) == {"urls": [], "workers": [], "pending": [url], "draining": []}
        # asking again while it is pending answers the same, without a second wait
        assert (await add(s, r.url, url))[0] == 202
        assert len(r.router.pending) == 1
        runner = await start_on(port)
        try:
            for _ in range(100):
                lw = await listed(s, r.url)
                if lw["urls"]:
                    break
                await asyncio.sleep(0.05)
            assert lw["urls"] == [url] and lw["pending"] == []
            assert f"added worker {url}" in caplog.text
            # a healthy worker is added within the answer time: 200
            port2 = free_port()
            runner2 = await start_on(port2)
            try:
                status, body, _ = await add(s, r.url, f"127.0.0.1:{port2}")
                assert (status, body["status"]) == (200, "added")
                assert (await listed(s, r.url))["urls"] == [url, f"http://127.0.0.1:{port2}"]
            finally:
                await runner2.cleanup()
        finally:
            await runner.cleanup()


@pytest.mark.timeout(30)
async def test_a_pending_worker_that_never_answers_is_dropped_with_a_log_line(monkeypatch, caplog, InProcessRouter):
    monkeypatch.setattr(admin, "ADD_WORKER_ANSWER_WITHIN_S", 0.2)
    url = f"http://127.0.0.1:{free_port()}"
    caplog.set_level(logging.INFO, logger="fleetserve.router")
    async with InProcessRouter(worker_startup_timeout_secs=0.6) as r, aiohttp.ClientSession() as s:
        assert (await add(s, r.url, url))[0] == 202
        await asyncio.sleep(1.2)
        assert await listed(s, r.url) == {"urls": [], "workers": [], "pending": [], "draining": []}
        assert f"worker {url} did not become healthy within 0.6 s: not added" in caplog.text
        # and /remove_worker ends a pending wait
        assert (await add(s, r.url, url))[0] == 202
        async with s.post(r.url + "/remove_worker", params={"url": url}) as resp:
            assert resp.status == 200
            assert (await resp.json())["message"] == f"stopped waiting for pending worker {url}"
        await asyncio.sleep(0.05)
        assert (await listed(s, r.url))["pending"] == []
