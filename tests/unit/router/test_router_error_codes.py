"""Every error the router writes has OpenAI's shape, and ``code`` is a string or null, never the status."""

import asyncio
import json
import socket

import aiohttp
import pytest
from aiohttp import web


def dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def slow_and_cut_app() -> web.Application:
    async def infer(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body.get("slow"):
            await asyncio.sleep(5)
            return web.json_response({})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"i": 0}\n\ndata: {"half')
        request.transport.close()
        return resp

    async def ok(request):
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/generate", infer)
    app.router.add_get("/health", ok)
    return app


def check_shape(body: dict) -> dict:
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and isinstance(err["type"], str)
    assert err["code"] is None or isinstance(err["code"], str), err
    return err


@pytest.mark.timeout(60)
async def test_router_error_codes_are_strings_or_null(InProcessRouter, start_app):
    runner, live = await start_app(slow_and_cut_app())
    seen = {}
    try:
        async with aiohttp.ClientSession() as s:
            async with InProcessRouter() as r:  # no worker at all
                async with s.post(r.url + "/generate", json={"text": "x"}) as resp:
                    seen["no worker"] = (resp.status, check_shape(await resp.json())["code"])
                async with s.get(r.url + "/v1/models") as resp:
                    seen["info, no worker"] = (resp.status, check_shape(await resp.json())["code"])
                async with s.post(r.url + "/generate", data=b"{nope") as resp:
                    seen["malformed JSON"] = (resp.status, check_shape(await resp.json())["code"])
                async with s.post(r.url + "/generate", data=b"") as resp:
                    j = check_shape(await resp.json())
                    seen["empty body"] = (resp.status, j["code"])
                    assert j["message"] == "request body is empty; send a JSON object"
                async with s.post(r.url + "/generate", data=b"[1]") as resp:
                    seen["not an object"] = (resp.status, check_shape(await resp.json())["code"])
                async with s.get(r.url + "/nope") as resp:
                    seen["no route"] = (resp.status, check_shape(await resp.json())["code"])
                async with s.get(r.url + "/generate") as resp:
                    seen["wrong method"] = (resp.status, check_shape(await resp.json())["code"])
                async with s.post(r.url + "/generate", data=b"x" * (2 << 20)) as resp:
                    seen["too large"] = (resp.status, check_shape(await resp.json())["code"])
                async with s.post(r.url + "/add_worker", params={"url": "notaurl"}) as resp:
                    seen["bad url"] = (resp.status, check_shape(await resp.json())["code"])
                async with s.post(r.url + "/remove_worker", params={"url": "127.0.0.1:9"}) as resp:
                    seen["unknown worker"] = (resp.status, check_shape(await resp.json())["code"])
            dead = dead_url()
            async with InProcessRouter(worker_urls=[dead], disable_health_check=True, disable_retries=True) as r:
                async with s.post(r.url + "/generate", json={"text": "x"}) as resp:
                    seen["worker down"] = (resp.status, check_shape(await resp.json())["code"])
                async with s.get(r.url + "/v1/models") as resp:
                    seen["info, worker down"] = (resp.status, check_shape(await resp.json())["code"])
                async with s.post(r.url + "/add_worker", params={"url": dead}) as resp:
                    seen["already registered"] = (resp.status, check_shape(await resp.json())["code"])
            async with InProcessRouter(worker_urls=[live], request_timeout_secs=0.5, disable_retries=True) as r:
                async with s.post(r.url + "/generate", json={"text": "x", "slow": True}) as resp:
                    seen["timeout"] = (resp.status, check_shape(await resp.json())["code"])
                async with s.post(r.url + "/generate", json={"text": "x", "stream": True}) as resp:
                    events = [ln for ln in (await resp.read()).split(b"\n\n") if ln.startswith(b"data: {\"error")]
                    assert len(events) == 1
                    seen["cut mid-stream"] = (resp.status, check_shape(json.loads(events[0][6:]))["code"])
    finally:
        await runner.cleanup()
    assert seen == {
        "no worker": (503, "no_healthy_worker"),
        "info, no worker": (503, "no_healthy_worker"),
        "malformed JSON": (400, "invalid_json"),  # as the engine answers it
        "empty body": (400, None),
        "not an object": (400, None),
        "no route": (404, None),
        "wrong method": (405, None),
        "too large": (413, "payload_too_large"),
        "bad url": (400, "invalid_worker_url"),
        "unknown worker": (404, "worker_not_found"),
        "worker down": (502, "upstream_error"),
        "info, worker down": (502, "upstream_error"),
        "already registered": (400, "worker_already_registered"),
        "timeout": (504, "upstream_timeout"),
        "cut mid-stream": (200, "upstream_error"),
    }
