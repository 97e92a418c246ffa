"""``GET /v1/models/{model_id}`` (OpenAI's retrieve model) through the router, and the router's ``GET /version``.

The worker is an in-process aiohttp app answering as ``fleetserve serve`` does:
``/v1/models/{name:path}`` gives the model card for the served name, else the
engine's 404 ``model_not_found`` (entrypoints/errors.py).
"""

import importlib.metadata

import aiohttp
import orjson
import pytest
from aiohttp import web

SERVED = "org/model-7b"
CARD = {"id": SERVED, "object": "model", "created": 1, "owned_by": "fleetserve", "root": "/models/m",
        "max_model_len": 4096}
NOT_FOUND = {"error": {"message": "the model 'nope' does not exist; this server serves 'org/model-7b'",
                       "type": "invalid_request_error", "param": "model", "code": "model_not_found"}}
KEY = "router-key-9"


def engine_like_app(seen: list) -> web.Application:
    async def retrieve(request: web.Request) -> web.Response:
        seen.append((request.path, request.headers.get("Authorization")))
        name = request.match_info["name"]
        if name != SERVED:
            body = dict(NOT_FOUND, error=dict(NOT_FOUND["error"], message=f"the model '{name}' does not exist; "
                                                                           f"this server serves '{SERVED}'"))
            return web.json_response(body, status=404)
        return web.json_response(CARD)

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200)

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models/{name:.*}", retrieve)
    return app


@pytest.fixture
async def engine_like(recording_worker):
    async with recording_worker(engine_like_app) as got:
        yield got


async def get(s, url, headers=None):
    async with s.get(url, headers=headers) as r:
        return r.status, await r.read(), r.headers


@pytest.mark.timeout(30)
async def test_retrieve_model_is_answered_by_a_worker_like_v1_models(engine_like, InProcessRouter):
    wurl, seen = engine_like
    async with InProcessRouter(worker_urls=[wurl]) as r, aiohttp.ClientSession() as s:
        st, body, h = await get(s, r.url + "/v1/models/" + SERVED)
        assert (st, orjson.loads(body), h["Content-Type"]) == (200, CARD, "application/json; charset=utf-8")
        st, body, _ = await get(s, r.url + "/v1/models/nope")  # the engine's 404, unchanged
        assert (st, orjson.loads(body)) == (404, NOT_FOUND)
        st, body, h = await get(s, r.url + "/v1/models/", None)  # no id: no route, as before
        assert st == 404 and orjson.loads(body)["error"]["message"] == "no route for /v1/models/"
        async with s.post(r.url + "/v1/models/" + SERVED) as resp:  # GET (and HEAD) only
            assert resp.status == 405 and resp.headers["Allow"] == "GET, HEAD"
    assert seen == [("/v1/models/" + SERVED, None), ("/v1/models/nope", None)]


@pytest.mark.timeout(30)
async def test_retrieve_model_is_open_with_api_key_as_v1_models_is(engine_like, InProcessRouter):
    wurl, seen = engine_like
    async with InProcessRouter(worker_urls=[wurl], api_key=KEY) as r, aiohttp.ClientSession() as s:
        st, body, _ = await get(s, r.url + "/v1/models/" + SERVED)
        assert (st, orjson.loads(body)) == (200, CARD)
        # the router's own key goes to the worker (its --api-key is the workers' key too, auth.py)
        assert seen == [("/v1/models/" + SERVED, f"Bearer {KEY}")]


@pytest.mark.timeout(30)
async def test_retrieve_model_without_a_worker_is_503(InProcessRouter):
    async with InProcessRouter(worker_urls=[]) as r, aiohttp.ClientSession() as s:
        st, body, _ = await get(s, r.url + "/v1/models/" + SERVED)
        assert st == 503 and orjson.loads(body) == {"error": {
            "message": "no healthy worker available", "type": "service_unavailable", "param": None,
            "code": "no_healthy_worker"}}


@pytest.mark.timeout(30)
async def test_version_is_answered_by_the_router_as_the_engine_does(InProcessRouter):
    expected = orjson.dumps({"version": importlib.metadata.version("fleetserve")})
    for cfg in ({}, {"api_key": KEY}):  # open with --api-key, as the engine's /version
        async with InProcessRouter(worker_urls=[], **cfg) as r, aiohttp.ClientSession() as s:
            st, body, h = await get(s, r.url + "/version")
            assert (st, body, h["Content-Type"]) == (200, expected, "application/json")
            async with s.post(r.url + "/version") as resp:
                assert resp.status == 405 and resp.headers["Allow"] == "GET, HEAD"
