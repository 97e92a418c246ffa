"""The router's endpoints other than inference, as handlers over a :class:`~.app.Router`.

* ``GET /health``: the router is up.  ``GET /readiness``: some worker can take
  a request (503 when none can).  ``GET /metrics``: Prometheus text.
* ``POST /add_worker?url=`` (waits for the worker's health check unless checks
  are off), ``POST /remove_worker?url=``, ``GET /list_workers``.
* ``GET /v1/models``, ``/get_model_info``, ``/get_server_info``: answered by
  one available worker, taken in turn; a worker that fails or answers 5xx is
  skipped for the next one.
* ``POST /flush_cache``: sent to every registered worker at once; 200 when all
  of them answered below 300, else 500, with each worker's status in the body.

These go through the router's aiohttp session, not the proxy's connection pool.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import aiohttp
import orjson

from . import health
from .http.server import Request, Response, json_error
from .http.client import UpstreamError
from .metrics import render
from .proxy import credential_headers, forwarded_response_headers
from .workers import Worker, normalize_url

if TYPE_CHECKING:
    from .app import Router

log = logging.getLogger("fleetserve.router")

INFO_PATHS = ("/v1/models", "/get_model_info", "/get_server_info")
_UPSTREAM_ERRORS = (UpstreamError, aiohttp.ClientError, asyncio.TimeoutError, OSError)
_JSON = "application/json"


# ---------------------------------------------------------------- the router itself
async def handle_health(router: Router, request: Request) -> Response:
    return Response(200, b'{"status":"ok"}')


async def handle_readiness(router: Router, request: Request) -> Response:
    n = len(router.registry.available())
    body = orjson.dumps({"ready": n > 0, "available_workers": n, "workers": len(router.registry)})
    return Response(200 if n else 503, body)


async def handle_metrics(router: Router, request: Request) -> Response:
    return Response(200, render(router.metrics_registry), "text/plain; version=0.0.4; charset=utf-8")


# ---------------------------------------------------------------- worker management
async def handle_add_worker(router: Router, request: Request) -> Response:
    raw = request.query.get("url")
    if not raw:
        return json_error(400, "missing ?url= query parameter")
    try:
        url = normalize_url(raw)
    except ValueError as e:
        return json_error(400, f"bad worker url: {e}")
    if router.registry.get(url) is not None:
        return json_error(400, f"worker {url} is already registered")
    c = router.cfg
    if not c.disable_health_check:
        ok = await health.wait_healthy(router.session, url, c.health_check_endpoint, c.worker_startup_timeout_secs,
                                       c.worker_startup_check_interval, c.health_check_timeout_secs)
        if not ok:
            return json_error(503, f"worker {url} did not become healthy within "
                                   f"{c.worker_startup_timeout_secs} s", "service_unavailable")
    # checked again: another /add_worker for the same url may have finished during the wait
    if not router.registry.add(router.new_worker(url)):
        return json_error(400, f"worker {url} is already registered")
    log.info("added worker %s", url)
    return Response(200, orjson.dumps({"success": True, "message": f"added worker {url}"}))


async def handle_remove_worker(router: Router, request: Request) -> Response:
    raw = request.query.get("url")
    if not raw:
        return json_error(400, "missing ?url= query parameter")
    try:
        worker = router.registry.remove(raw)
    except ValueError as e:
        return json_error(400, f"bad worker url: {e}")
    if worker is None:
        return json_error(404, f"worker {raw} is not registered", "not_found_error")
    router.policy.on_worker_removed(worker.url)
    router.pool.forget(worker.url)
    log.info("removed worker %s (%d requests still in flight)", worker.url, worker.load)
    return Response(200, orjson.dumps({"success": True, "message": f"removed worker {worker.url}"}))


async def handle_list_workers(router: Router, request: Request) -> Response:
    body = {
        "urls": router.registry.urls(),
        "workers": [{"url": w.url, "healthy": w.healthy, "load": w.load, "circuit": w.breaker.state}
                    for w in router.registry.workers],
    }
    return Response(200, orjson.dumps(body))


# ---------------------------------------------------------------- passed to the workers
async def handle_info(router: Router, request: Request) -> Response:
    workers = router.registry.available()
    if not workers:
        return json_error(503, "no healthy worker available", "service_unavailable")
    last = None
    creds = credential_headers(request)
    for i in range(len(workers)):
        worker = workers[(router.info_turn + i) % len(workers)]
        try:
            async with router.session.get(worker.url + request.path, headers=creds,
                                          timeout=aiohttp.ClientTimeout(total=30)) as resp:
                data = await resp.read()
                if resp.status < 500:
                    router.info_turn += 1
                    return Response(resp.status, data, resp.headers.get("Content-Type", _JSON),
                                    forwarded_response_headers(resp.headers.items()))
                last = f"{worker.url} answered {resp.status}"
        except _UPSTREAM_ERRORS as e:
            last = f"{worker.url}: {type(e).__name__}"
    return json_error(502, f"no worker answered {request.path}: {last}", "bad_gateway")


async def handle_flush_cache(router: Router, request: Request) -> Response:
    workers = list(router.registry.workers)
    creds = credential_headers(request)

    async def one(w: Worker):
        try:
            async with router.session.post(w.url + "/flush_cache", headers=creds,
                                           timeout=aiohttp.ClientTimeout(total=30)) as r:
                await r.read()
                return r.status
        except _UPSTREAM_ERRORS as e:
            return f"{type(e).__name__}"

    results = await asyncio.gather(*(one(w) for w in workers))
    per = {w.url: s for w, s in zip(workers, results)}
    ok = all(isinstance(s, int) and s < 300 for s in results)
    return Response(200 if ok else 500, orjson.dumps({"success": ok, "workers": per}))
