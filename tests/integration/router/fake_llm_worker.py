"""A tiny aiohttp stand-in for an LLM worker, for the router's end-to-end tests.

Run: ``python fake_llm_worker.py --port P --name NAME``.  Request fields steer it:
``fake_sleep`` (seconds before answering), ``fake_status`` (status code),
``stream: true`` (SSE of ``fake_chunks`` chunks, ``fake_chunk_delay`` s apart;
``fake_die_after: n`` sends half an event after ``n`` chunks and drops the connection).
Every answer names the worker (JSON field ``worker``).  ``GET /stats`` returns
request and flush counts.  ``--unhealthy-file PATH``: /health answers 503 while
PATH exists.
"""

import argparse
import asyncio
import json
import os

from aiohttp import web


def build(name: str, unhealthy_file: str | None) -> web.Application:
    stats = {"requests": 0, "flushes": 0, "health": 0, "paths": {}}

    async def infer(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        stats["requests"] += 1
        stats["paths"][request.path] = stats["paths"].get(request.path, 0) + 1
        await asyncio.sleep(float(body.get("fake_sleep", 0)))
        status = int(body.get("fake_status", 200))
        if status != 200:
            return web.json_response({"error": {"message": f"fake {status}", "code": status}, "worker": name},
                                     status=status)
        if body.get("stream") is True:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Fake-Worker": name})
            await resp.prepare(request)
            die_after = body.get("fake_die_after")  # chunks sent before the connection drops
            for i in range(int(body.get("fake_chunks", 3))):
                if die_after is not None and i == int(die_after):
                    await resp.write(b'data: {"worker": "cut in the mid')  # half an event, then gone
                    request.transport.close()
                    return resp
                await resp.write(f"data: {json.dumps({'worker': name, 'i': i})}\n\n".encode())
                await asyncio.sleep(float(body.get("fake_chunk_delay", 0)))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        return web.json_response({"worker": name, "text": "ok", "echo_len": len(await request.read())},
                                 headers={"X-Fake-Worker": name})

    async def health(request: web.Request) -> web.Response:
        stats["health"] += 1
        if unhealthy_file and os.path.exists(unhealthy_file):
            return web.json_response({"ok": False}, status=503)
        return web.json_response({"ok": True})

    async def info(request: web.Request) -> web.Response:
        if request.path == "/v1/models":
            return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}],
                                      "worker": name})
        return web.json_response({"model_path": "fake-model", "worker": name})

    async def flush(request: web.Request) -> web.Response:
        stats["flushes"] += 1
        return web.json_response({"ok": True})

    async def get_stats(request: web.Request) -> web.Response:
        return web.json_response(stats)

    app = web.Application()
    for p in ("/generate", "/v1/completions", "/v1/chat/completions"):
        app.router.add_post(p, infer)
    for p in ("/v1/models", "/get_model_info", "/get_server_info"):
        app.router.add_get(p, info)
    app.router.add_get("/health", health)
    app.router.add_post("/flush_cache", flush)
    app.router.add_get("/stats", get_stats)
    return app


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--unhealthy-file", default=None)
    a = ap.parse_args()
    web.run_app(build(a.name, a.unhealthy_file), host="127.0.0.1", port=a.port, access_log=None, print=None)
