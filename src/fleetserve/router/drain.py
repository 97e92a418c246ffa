"""``POST /drain_worker?url=``: take a worker out of service gracefully (ours; sglang-router has no drain).

1. The worker gets no new request at once (it is no longer *available*);
   ``GET /list_workers`` shows it with ``"draining": true`` and lists its url
   under ``"draining"``.
2. Its requests in flight, streams included, go on.  As soon as none is left,
   or ``--drain-timeout-secs`` after the drain began, it is removed as by
   ``/remove_worker`` (dropped from routing and from the tree; a request still
   in flight at the timeout still finishes).

Answers: 202 ``{"success": true, "status": "draining", "in_flight": n}`` (also
when asked again while it drains), 400 for a missing or bad url, 404
``worker_not_found`` for an unknown one.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import orjson

from .admin import remove
from .http.server import Request, Response, json_error
from .workers import Worker, normalize_url

if TYPE_CHECKING:
    from .app import Router

log = logging.getLogger("fleetserve.router")
POLL_S = 0.05  # how often a drain looks at the worker's in-flight count


async def handle_drain_worker(router: Router, request: Request) -> Response:
    raw = request.query.get("url")
    if not raw:
        return json_error(400, "missing ?url= query parameter", param="url", code="invalid_worker_url")
    try:
        url = normalize_url(raw)
    except ValueError as e:
        return json_error(400, f"bad worker url: {e}", param="url", code="invalid_worker_url")
    worker = router.registry.get(url)
    if worker is None:
        return json_error(404, f"worker {url} is not registered", "not_found_error", param="url",
                          code="worker_not_found")
    if url not in router.drains:
        worker.draining = True
        timeout = router.cfg.drain_timeout_secs
        log.info("draining worker %s: no new requests; %d in flight, waiting up to %g s", url, worker.load, timeout)
        router.drains[url] = asyncio.ensure_future(_drain(router, worker, timeout))
    return Response(202, orjson.dumps({"success": True, "status": "draining", "in_flight": worker.load,
                                       "message": f"draining worker {url}"}))


async def _drain(router: Router, worker: Worker, timeout_s: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    try:
        while worker.load > 0 and not worker.removed and loop.time() < deadline:
            await asyncio.sleep(POLL_S)
        if worker.removed:  # /remove_worker came first
            return
        left = worker.load
        remove(router, worker.url)  # as /remove_worker: routing, the policy's state, sessions, pooled connections
        if left:
            log.warning("drained worker %s removed after %g s with %d requests still in flight", worker.url,
                        timeout_s, left)
        else:
            log.info("drained worker %s removed (no request in flight)", worker.url)
    finally:
        if router.drains.get(worker.url) is asyncio.current_task():
            del router.drains[worker.url]
