"""The client's credentials reach the worker on every proxied route, and bench can send a key.

An in-process aiohttp worker that, like ``fleetserve serve --api-key``, answers
401 (with ``WWW-Authenticate: Bearer``) unless ``Authorization: Bearer <KEY>``
is sent, on every path but ``/health``; a router in the same event loop.
"""


import aiohttp
import pytest
from aiohttp import web


KEY = "sk-test-123"


def keyed_worker_app(seen: list, key: str = KEY) -> web.Application:
    @web.middleware
    async def need_key(request: web.Request, handler):
        seen.append((request.path, request.headers.get("Authorization"), request.headers.get("x-api-key")))
        if request.path != "/health" and request.headers.get("Authorization") != f"Bearer {key}":
            return web.json_response({"error": {"message": "missing API key", "type": "authentication_error",
                                                "param": None, "code": "invalid_api_key"}},
                                     status=401, headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"path": request.path, "object": "list", "data": [{"id": "m"}]})

    app = web.Application(middlewares=[need_key])
    for p in ("/v1/models", "/get_model_info", "/get_server_info", "/health", "/get_load"):
        app.router.add_get(p, ok)
    for p in ("/flush_cache", "/generate", "/v1/completions", "/v1/chat/completions"):
        app.router.add_post(p, ok)
    return app


@pytest.fixture
async def keyed_worker(recording_worker):
    async with recording_worker(keyed_worker_app) as got:
        yield got


@pytest.mark.timeout(30)
async def test_authorization_is_forwarded_on_every_proxied_route(keyed_worker, InProcessRouter):
    wurl, seen = keyed_worker
    good = {"Authorization": f"Bearer {KEY}"}
    async with InProcessRouter(worker_urls=[wurl]) as r, aiohttp.ClientSession() as s:
        for path in ("/v1/models", "/get_model_info", "/get_server_info"):
            async with s.get(r.url + path, headers=good) as resp:
                assert resp.status == 200, path
                assert (await resp.json())["path"] == path
            async with s.get(r.url + path) as resp:  # no key: the worker's 401 passes through as it is
                assert resp.status == 401, path
                assert resp.headers["WWW-Authenticate"] == "Bearer"
                assert (await resp.json())["error"]["code"] == "invalid_api_key"
        for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
            async with s.post(r.url + path, json={"prompt": "hi"}, headers=good) as resp:
                assert resp.status == 200, path
            async with s.post(r.url + path, json={"prompt": "hi"}) as resp:
                assert resp.status == 401, path
                assert resp.headers["WWW-Authenticate"] == "Bearer"
        async with s.post(r.url + "/flush_cache", headers=good) as resp:
            assert resp.status == 200
            assert await resp.json() == {"success": True, "workers": {wurl: 200}}
        async with s.post(r.url + "/flush_cache") as resp:
            assert resp.status == 500
            assert await resp.json() == {"success": False, "workers": {wurl: 401}}
        # the other credential header forms go through too
        async with s.get(r.url + "/v1/models", headers={**good, "X-Api-Key": "other"}) as resp:
            assert resp.status == 200
    assert ("/v1/models", f"Bearer {KEY}", "other") in seen
    assert ("/flush_cache", f"Bearer {KEY}", None) in seen


@pytest.mark.timeout(30)
async def test_openai_client_lists_models_and_chats_through_the_router(keyed_worker, InProcessRouter):
    openai = pytest.importorskip("openai")
    wurl, _ = keyed_worker
    async with InProcessRouter(worker_urls=[wurl]) as r:
        client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key=KEY, max_retries=0)
        models = await client.models.list()
        assert [m.id for m in models.data] == ["m"]
        bad = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await bad.models.list()
        await client.close()
        await bad.close()


@pytest.mark.timeout(30)
async def test_bench_sends_its_api_key(keyed_worker, monkeypatch):
    from fleetserve.bench import cli as bench_cli
    from fleetserve.bench.client import run_requests
    from fleetserve.bench.workloads import random_prompts

    wurl, seen = keyed_worker
    reqs = random_prompts(num_prompts=2, input_len=4, output_len=2, seed=0)
    await run_requests(wurl, reqs, stream=False, progress=False, api_key=KEY)
    assert [a for p, a, _ in seen if p == "/v1/chat/completions"] == [f"Bearer {KEY}"] * 2
    assert await bench_cli.flush_workers([wurl], KEY) == {wurl: 200}
    assert await bench_cli.flush_workers([wurl]) == {wurl: 401}
    # the flag, with $OPENAI_API_KEY as its default
    monkeypatch.setenv("OPENAI_API_KEY", "from-env")
    assert bench_cli.build_parser().parse_args([]).api_key == "from-env"
    assert bench_cli.build_parser().parse_args(["--api-key", "k"]).api_key == "k"
    monkeypatch.delenv("OPENAI_API_KEY")
    assert bench_cli.build_parser().parse_args([]).api_key is None


@pytest.mark.timeout(30)
async def test_api_key_is_the_workers_key_on_the_routers_own_requests(keyed_worker, InProcessRouter):
    """``--api-key K`` is also the workers' key, as sglang-router's: the start-up health check (here on a
    keyed path), kv_aware's /get_server_info and the info routes a client calls without a key (open on
    the router) reach a worker started with K; a client's own Authorization is still passed on instead."""
    import asyncio

    wurl, seen = keyed_worker
    mine = ("/get_server_info", f"Bearer {KEY}", None)
    async with InProcessRouter(worker_urls=[wurl], api_key=KEY, policy="kv_aware",
                               health_check_endpoint="/get_model_info") as r, aiohttp.ClientSession() as s:
        assert ("/get_model_info", f"Bearer {KEY}", None) in seen  # the start-up check passed with the key
        for _ in range(100):  # kv_aware asks the worker for its KV-event publisher at start
            if mine in seen:
                break
            await asyncio.sleep(0.05)
        assert mine in seen
        assert not r.router.kv_sources._why  # it answered 200 (not "answered 401")
        async with s.get(r.url + "/v1/models") as resp:  # open on the router; the worker gets the key
            assert resp.status == 200
            assert (await resp.json())["path"] == "/v1/models"
        async with s.get(r.url + "/v1/models", headers={"Authorization": "Bearer other"}) as resp:
            assert resp.status == 401  # the client's own credential wins, as without --api-key
        async with s.post(r.url + "/flush_cache") as resp:
            assert resp.status == 401  # the router's own check first
        async with s.post(r.url + "/flush_cache", headers={"Authorization": f"Bearer {KEY}"}) as resp:
            assert await resp.json() == {"success": True, "workers": {wurl: 200}}
        async with s.post(r.url + "/v1/completions", json={"prompt": "hi"},
                          headers={"Authorization": f"Bearer {KEY}"}) as resp:
            assert resp.status == 200
    assert ("/v1/models", f"Bearer {KEY}", None) in seen


@pytest.mark.timeout(30)
async def test_a_worker_added_with_its_own_api_key_gets_that_key_on_every_request(start_app, InProcessRouter):
    """``POST /workers {"url", "api_key"}`` (smg's per-worker key): the health checks, kv_aware's
    /get_server_info, the info routes, /flush_cache, /get_load and proxied inference all reach the worker
    with its own key, in place of the router's ``--api-key`` and of the client's credentials; GET
    /workers does not show it.  A worker registered without one keeps getting the router's key."""
    import asyncio

    own = "sk-worker-only"
    seen: list = []
    runner, wurl = await start_app(keyed_worker_app(seen, own))
    seen_plain: list = []
    runner2, purl = await start_app(keyed_worker_app(seen_plain))  # keyed with the router's KEY
    admin = {"Authorization": f"Bearer {KEY}"}
    try:
        async with InProcessRouter(worker_urls=[purl], api_key=KEY, policy="kv_aware",
                                   health_check_endpoint="/get_model_info", health_check_interval_secs=0.1,
                                   ) as r, aiohttp.ClientSession() as s:
            async with s.post(r.url + "/workers", json={"url": wurl, "api_key": own}, headers=admin) as resp:
                assert resp.status == 202
            for _ in range(100):
                if wurl in r.router.registry.urls():
                    break
                await asyncio.sleep(0.05)
            assert wurl in r.router.registry.urls()  # its health check (a keyed path) passed with its key
            async with s.get(r.url + "/workers", headers=admin) as resp:
                assert own not in await resp.text()
            # a client's credential for the router is not what the worker gets
            async with s.post(r.url + "/v1/completions", json={"prompt": "hi"},
                              headers={**admin, "x-api-key": "client"}) as resp:
                assert resp.status == 200
            async with s.post(r.url + "/flush_cache", headers=admin) as resp:
                assert await resp.json() == {"success": True, "workers": {purl: 200, wurl: 200}}
            from urllib.parse import quote
            async with s.delete(r.url + "/workers/" + quote(purl, safe=""), headers=admin) as resp:
                assert resp.status == 200
            for stream in (False, True):  # now it is the only worker: proxied inference reaches it
                async with s.post(r.url + "/v1/completions", json={"prompt": "only", "stream": stream},
                                  headers={**admin, "api-key": "client"}) as resp:
                    assert resp.status == 200
                    await resp.read()
            async with s.get(r.url + "/get_loads", headers=admin) as resp:
                assert resp.status == 200
            for _ in range(100):  # kv_aware asked it for its KV-event publisher, with its key
                if ("/get_server_info", f"Bearer {own}", None) in seen:
                    break
                await asyncio.sleep(0.05)
        assert ("/get_server_info", f"Bearer {own}", None) in seen
        assert ("/get_model_info", f"Bearer {own}", None) in seen
        assert ("/flush_cache", f"Bearer {own}", None) in seen
        assert {a for p, a, _ in seen} == {f"Bearer {own}"}  # never the router's key, never the client's
        assert [a for p, a, _ in seen if p == "/v1/completions"][-2:] == [f"Bearer {own}"] * 2
        assert ("/get_load", f"Bearer {own}", None) in seen
        assert ("/flush_cache", f"Bearer {KEY}", None) in seen_plain  # the other keeps the router's key
        assert {a for p, a, _ in seen_plain} == {f"Bearer {KEY}"}
    finally:
        await runner.cleanup()
        await runner2.cleanup()


@pytest.mark.timeout(30)
async def test_add_worker_takes_the_workers_own_api_key_in_its_query(start_app, InProcessRouter):
    """sglang-router's ``/add_worker?url=&api_key=``: the start-up wait and proxied inference reach the
    worker with that key; a blank or multi-line key is a 400 naming ``api_key``, and nothing is added."""
    from urllib.parse import quote

    own = "sk-added"
    seen: list = []
    runner, wurl = await start_app(keyed_worker_app(seen, own))
    try:
        async with InProcessRouter(worker_urls=[], health_check_endpoint="/get_model_info") as r, \
                aiohttp.ClientSession() as s:
            for bad in (" ", "a\nb"):
                async with s.post(r.url + f"/add_worker?url={quote(wurl)}&api_key={quote(bad)}") as resp:
                    assert resp.status == 400
                    assert (await resp.json())["error"]["param"] == "api_key"
            assert r.router.registry.urls() == []
            async with s.post(r.url + f"/add_worker?url={quote(wurl)}&api_key={own}") as resp:
                assert resp.status == 200
            async with s.post(r.url + "/v1/completions", json={"prompt": "hi"},
                              headers={"Authorization": "Bearer client"}) as resp:
                assert resp.status == 200
    finally:
        await runner.cleanup()
    assert ("/get_model_info", f"Bearer {own}", None) in seen
    assert ("/v1/completions", f"Bearer {own}", None) in seen
