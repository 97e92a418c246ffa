"""The router's endpoints other than inference, as handlers over a :class:`~.app.Router`.

* ``GET /version``: ``{"version": ...}``, fleetserve's version (vLLM's route, as the engine's).
* ``GET /health``: the router is up.  ``GET /readiness``: some worker can take
  a request (503 when none can).  ``GET /metrics``: Prometheus text.
* ``POST /add_worker?url=[&api_key=]``: ``api_key`` (sglang-router's) is the worker's
  own key, as ``POST /workers``'s (auth.py); a bad url is a 400 at once; the worker is added
  once its health check passes (200 if that takes under
  :data:`ADD_WORKER_ANSWER_WITHIN_S`, else 202 pending and the wait goes on in
  the background).  ``POST /remove_worker?url=`` (also ends a pending wait),
  ``GET /list_workers`` (pending urls listed apart, under ``pending``).
* ``GET /v1/models``, ``/v1/models/{model_id}``, ``/get_model_info``, ``/get_server_info``:
  answered by one available worker, taken in turn; a worker that fails or answers 5xx is
  skipped for the next one.
* ``POST /flush_cache``: sent to every registered worker at once; 200 when all
  of them answered below 300, else 500, with each worker's status in the body.

These go through the router's aiohttp session, not the proxy's connection pool.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
from typing import TYPE_CHECKING

import aiohttp
import orjson

from . import health, worker_view
from .auth import for_worker
from .http.server import Request, Response, json_error
from .http.client import UpstreamError
from .metrics import render
from .proxy import credential_headers, forwarded_response_headers
from .via import loop_answer
from .workers import Worker, normalize_url

if TYPE_CHECKING:
    from .app import Router

log = logging.getLogger("fleetserve.router")

INFO_PATHS = ("/v1/models", "/get_model_info", "/get_server_info")
# GET /v1/models/{model_id} (OpenAI's "retrieve model"; the engine's /v1/models/{name}): answered like
# /v1/models, by one available worker, the path passed on as it came (ids with "/" included); an unknown
# id gets the worker's own 404 (model_not_found) unchanged
MODEL_PREFIX = "/v1/models/"
_UPSTREAM_ERRORS = (UpstreamError, aiohttp.ClientError, asyncio.TimeoutError, OSError)
_JSON = "application/json"


# the installed fleetserve's version, read as the engine reads it (entrypoints/version.py, which the
# router may not import): the package metadata, "unknown" from a source tree never installed
try:
    PACKAGE_VERSION: str = importlib.metadata.version("fleetserve")
except importlib.metadata.PackageNotFoundError:
    PACKAGE_VERSION = "unknown"
_VERSION_BODY = orjson.dumps({"version": PACKAGE_VERSION})


# ---------------------------------------------------------------- the router itself
async def handle_version(router: Router, request: Request) -> Response:
    """vLLM's ``GET /version``, as the engine answers it: ``{"version": "<fleetserve's version>"}``;
    open with ``--api-key``, as on the engine."""
    return Response(200, _VERSION_BODY)


async def handle_health(router: Router, request: Request) -> Response:
    """200, or 508 to a check that came from this very router (its own ``Via`` entry: :mod:`.via`)."""
    if "via" in request.headers:
        looped = loop_answer(request.headers, router.via, request.path)
        if looped is not None:
            return looped
    return Response(200, b'{"status":"ok"}')


async def handle_readiness(router: Router, request: Request) -> Response:
    """200 while some worker can take a request; 503 with none, or once shutdown began.

    ``status`` / ``reason`` / ``healthy_workers`` / ``total_workers`` as in sglang-router 0.3.2.
    """
    n = len(router.registry.available())
    ready = n > 0 and not router.shutting_down
    body = {"status": "ready" if ready else "not ready", "healthy_workers": n, "total_workers": len(router.registry),
            "ready": ready, "available_workers": n, "workers": len(router.registry)}
    if not ready:
        body["reason"] = "shutting down" if router.shutting_down else "insufficient healthy workers"
    return Response(200 if ready else 503, orjson.dumps(body))


async def handle_metrics(router: Router, request: Request) -> Response:
    return Response(200, render(router.metrics_registry), "text/plain; version=0.0.4; charset=utf-8")


# ---------------------------------------------------------------- worker management
async def handle_add_worker(router: Router, request: Request) -> Response:
    """Validate the url at once; add the worker when its health check passes.

    200 when it is added within :data:`ADD_WORKER_ANSWER_WITHIN_S`; otherwise 202
    ``{"status": "pending"}`` while the wait goes on in the background (up to
    ``--worker-startup-timeout-secs``), logged when it starts and when it ends.
    """
    raw = request.query.get("url")
    if not raw:
        return json_error(400, "missing ?url= query parameter", param="url", code="invalid_worker_url")
    try:
        url = normalize_url(raw)
    except ValueError as e:
        return json_error(400, f"bad worker url: {e}", param="url", code="invalid_worker_url")
    if router.registry.get(url) is not None:
        return json_error(400, f"worker {url} is already registered", param="url",
                          code="worker_already_registered")
    key = request.query.get("api_key")  # sglang-router's /add_worker?url=&api_key=: the worker's own key
    if key is not None and (not key.strip() or "\r" in key or "\n" in key):
        return json_error(400, "api_key must be a non-empty string on one line (the worker's own key)",
                          param="api_key", code="invalid_api_key")
    c = router.cfg
    if c.disable_health_check:
        router.registry.add(router.new_worker(url, key))
        log.info("added worker %s (health checks off)", url)
        return Response(200, orjson.dumps({"success": True, "status": "added", "message": f"added worker {url}"}))
    task = begin_add(router, url, key)
    done, _ = await asyncio.wait((task,), timeout=ADD_WORKER_ANSWER_WITHIN_S)
    if not done:
        return Response(202, orjson.dumps({
            "success": True, "status": "pending",
            "message": f"worker {url} does not answer {c.health_check_endpoint} yet; it is added once it does "
                       f"(waiting up to {c.worker_startup_timeout_secs:g} s; see /list_workers)"}))
    if task.cancelled():
        return json_error(409, f"worker {url} was removed while waiting for its health check",
                          "conflict_error", param="url", code="worker_removed")
    outcome = task.result()
    if outcome == "added":
        return Response(200, orjson.dumps({"success": True, "status": "added", "message": f"added worker {url}"}))
    if outcome == "duplicate":
        return json_error(400, f"worker {url} is already registered", param="url",
                          code="worker_already_registered")
    if outcome == "loop":
        return json_error(400, f"{url} is this router itself: every request sent there would loop", param="url",
                          code="worker_is_this_router")
    return json_error(503, f"worker {url} did not become healthy within {c.worker_startup_timeout_secs:g} s",
                      "service_unavailable", code="worker_not_healthy")


def begin_add(router: Router, url: str, api_key: str | None = None) -> asyncio.Task:
    """The background wait that adds normalized ``url`` once healthy: the one under way, else a new one.

    ``api_key``: the worker's own key (``POST /workers``), used for its health checks and kept on it."""
    task = router.pending.get(url)
    if task is None:
        c = router.cfg
        log.info("worker %s: waiting up to %g s for its health check (%s) before adding it", url,
                 c.worker_startup_timeout_secs, c.health_check_endpoint)
        task = router.pending[url] = asyncio.ensure_future(_add_when_healthy(router, url, api_key))
    return task


# how long POST /add_worker waits for the health check before answering 202 pending
ADD_WORKER_ANSWER_WITHIN_S = 3.0


async def _add_when_healthy(router: Router, url: str, api_key: str | None = None) -> str:
    """Wait for ``url``'s health check, then register it: ``"added"``, ``"duplicate"``, ``"unhealthy"``, or
    ``"loop"`` when ``url`` is this router itself (:func:`.health.points_back`)."""
    c = router.cfg
    try:
        if await health.points_back(router.session, url, router.via, c.health_check_timeout_secs, api_key):
            log.warning("worker %s is this router itself (its /health answered this router's own Via entry with "
                        "508): not added, every request to it would loop", url)
            return "loop"
        ok = await health.wait_healthy(router.session, url, c.health_check_endpoint, c.worker_startup_timeout_secs,
                                       c.worker_startup_check_interval, c.health_check_timeout_secs, api_key)
        if not ok:
            log.warning("worker %s did not become healthy within %g s: not added", url, c.worker_startup_timeout_secs)
            return "unhealthy"
        # another path (start-up, health checks off) may have registered it during the wait
        if not router.registry.add(router.new_worker(url, api_key)):
            return "duplicate"
        log.info("added worker %s", url)
        return "added"
    finally:
        if router.pending.get(url) is asyncio.current_task():
            del router.pending[url]


async def handle_remove_worker(router: Router, request: Request) -> Response:
    raw = request.query.get("url")
    if not raw:
        return json_error(400, "missing ?url= query parameter", param="url", code="invalid_worker_url")
    try:
        url = normalize_url(raw)
    except ValueError as e:
        return json_error(400, f"bad worker url: {e}", param="url", code="invalid_worker_url")
    message = remove(router, url)
    if message is None:
        return json_error(404, f"worker {raw} is not registered", "not_found_error", param="url",
                          code="worker_not_found")
    return Response(200, orjson.dumps({"success": True, "message": message}))


def remove(router: Router, url: str) -> str | None:
    """Drop normalized ``url`` (registered, or still pending); a message saying what was done, None if unknown.

    A registered worker leaves routing, the policy's state and the sticky
    sessions at once.  Its streams that can migrate move to another worker at
    their next event, and their requests on it are aborted (:mod:`.migration`);
    its other requests in flight finish there.  Its pooled connections are
    closed (those in use once their request ends).
    """
    worker = router.registry.remove(url)
    if worker is None:
        task = router.pending.pop(url, None)
        if task is None:
            return None
        task.cancel()
        log.info("worker %s: no longer waiting for it (removed while pending)", url)
        return f"stopped waiting for pending worker {url}"
    router.policy.on_worker_removed(worker.url)
    if router.sessions is not None:
        router.sessions.forget_worker(worker.url)
    router.pool.forget(worker.url)
    log.info("removed worker %s (%d requests still in flight)", worker.url, worker.load)
    return f"removed worker {worker.url}"


async def handle_list_workers(router: Router, request: Request) -> Response:
    body = {
        "urls": router.registry.urls(),
        # each as worker_view.describe: "is_healthy" is false as soon as the circuit opens or an attempt fails
        "workers": [worker_view.describe(w) for w in router.registry.workers],
        # POST /drain_worker urls: still listed (and in "urls") until drained, but get no new requests
        "draining": [w.url for w in router.registry.workers if w.draining],
        # /add_worker urls still waiting for their first good health check: not routed to, not in "urls"
        "pending": list(router.pending),
    }
    return Response(200, orjson.dumps(body))


# ---------------------------------------------------------------- passed to the workers
async def handle_info(router: Router, request: Request) -> Response:
    looped = loop_answer(request.headers, router.via, request.path)  # the session's requests carry Via
    if looped is not None:
        return looped
    workers = router.registry.available()
    if not workers:
        return json_error(503, "no healthy worker available", "service_unavailable", code="no_healthy_worker")
    last = None
    creds = credential_headers(request)
    for i in range(len(workers)):
        worker = workers[(router.info_turn + i) % len(workers)]
        try:
            async with router.session.get(worker.url + request.path, headers=for_worker(worker.api_key, creds),
                                          timeout=aiohttp.ClientTimeout(total=30)) as resp:
                data = await resp.read()
                if resp.status < 500:
                    router.info_turn += 1
                    return Response(resp.status, data, resp.headers.get("Content-Type", _JSON),
                                    forwarded_response_headers(resp.headers.items()))
                last = f"{worker.url} answered {resp.status}"
        except _UPSTREAM_ERRORS as e:
            last = f"{worker.url}: {type(e).__name__}"
    return json_error(502, f"no worker answered {request.path}: {last}", "bad_gateway", code="upstream_error")


async def handle_flush_cache(router: Router, request: Request) -> Response:
    looped = loop_answer(request.headers, router.via, request.path)
    if looped is not None:
        return looped
    workers = list(router.registry.workers)
    creds = credential_headers(request)

    async def one(w: Worker):
        try:
            async with router.session.post(w.url + "/flush_cache", headers=for_worker(w.api_key, creds),
                                           timeout=aiohttp.ClientTimeout(total=30)) as r:
                await r.read()
                return r.status
        except _UPSTREAM_ERRORS as e:
            return f"{type(e).__name__}"

    results = await asyncio.gather(*(one(w) for w in workers))
    per = {w.url: s for w, s in zip(workers, results)}
    flushed = getattr(router.policy, "on_cache_flushed", None)  # cache_aware, kv_aware: its entries go too
    if flushed is not None:
        for w, s in zip(workers, results):
            if isinstance(s, int) and 200 <= s < 300:
                flushed(w.url)
    ok = all(isinstance(s, int) and s < 300 for s in results)
    return Response(200 if ok else 500, orjson.dumps({"success": ok, "workers": per}))
