"""The worker REST routes of smg / sglang-router's model gateway, over the same registry as ``/add_worker``.

* ``GET /workers``: ``{"workers": [...], "total": n, "stats": {"prefill_count": 0,
  "decode_count": 0, "regular_count": n}}`` (smg's shape), each worker as
  :func:`.worker_view.describe`; urls still pending their first good health
  check are listed too, with ``"status": "pending"`` (they are not counted in
  ``total``, which counts registered workers, as smg's registry does).
* ``GET /workers/{url}``: one worker, or a pending url; 404 ``worker_not_found``.
* ``POST /workers`` with a JSON body ``{"url": ..., "api_key": ...}`` (the key is optional: the
  worker's own, sent to it instead of ``--api-key`` and of the client's credentials, auth.py; not
  shown by the GET routes): as smg, 202
  ``{"status": "accepted", "worker_id", "url", "location", "message"}`` with a
  ``Location: /workers/{url}`` header; the worker is added once its health
  check passes (at once with ``--disable-health-check``), which ``GET
  /workers/{url}`` shows (``pending`` -> ``ready``).  409
  ``worker_already_exists`` for a registered url (smg: 409 too).
* ``DELETE /workers/{url}``: removes it as ``/remove_worker`` does (or ends a
  pending wait): 200 ``{"success": true, "status": "removed", "worker_id", "message"}``
  (smg answers 202 since its removal is queued; ours is done when it answers).

``{url}`` is the worker url, percent-encoded (``http%3A%2F%2Fh%3A8000``) or
not (``http://h:8000``, ``h:8000``); it is normalized as ``--worker-urls`` are.
smg names a worker by a UUID it makes up; the router names it by its url, so
``worker_id`` is the url.  Errors are the router's OpenAI-style JSON
(``{"error": {"message", "type", "param", "code"}}``) where smg writes
``{"error": str, "code": "WORKER_NOT_FOUND"}``; the status codes are smg's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import quote, unquote

import orjson

from . import admin, worker_view
from .http.server import Request, Response, json_error
from .workers import normalize_url

if TYPE_CHECKING:
    from .app import Router

PREFIX = "/workers/"


def _location(url: str) -> str:
    return PREFIX + quote(url, safe="")


def _url_of(request: Request) -> str:
    """The normalized worker url after ``/workers/``; raises ``ValueError`` if it is not one."""
    return normalize_url(unquote(request.path[len(PREFIX):]))


async def handle_list(router: Router, request: Request) -> Response:
    registered = [worker_view.describe(w) for w in router.registry.workers]
    pending = [worker_view.describe_pending(u) for u in router.pending]
    body = {"workers": registered + pending, "total": len(registered),
            "stats": {"prefill_count": 0, "decode_count": 0, "regular_count": len(registered)}}
    return Response(200, orjson.dumps(body))


async def handle_get(router: Router, request: Request) -> Response:
    try:
        url = _url_of(request)
    except ValueError as e:
        return json_error(400, f"bad worker url: {e}", param="url", code="invalid_worker_url")
    worker = router.registry.get(url)
    if worker is not None:
        return Response(200, orjson.dumps(worker_view.describe(worker)))
    if url in router.pending:
        return Response(200, orjson.dumps(worker_view.describe_pending(url)))
    return json_error(404, f"worker {url} is not registered", "not_found_error", param="url",
                      code="worker_not_found")


async def handle_create(router: Router, request: Request) -> Response:
    try:
        body = orjson.loads(request.body)
    except orjson.JSONDecodeError as e:
        return json_error(400, f"malformed JSON body: {e}", code="invalid_json")
    if type(body) is not dict:
        return json_error(400, "the request body must be a JSON object")
    raw = body.get("url")
    if not isinstance(raw, str) or not raw:
        return json_error(400, "the body needs \"url\": the worker's http://host:port", param="url",
                          code="invalid_worker_url")
    key = body.get("api_key")
    if key is not None and (not isinstance(key, str) or not key.strip() or any(c in key for c in "\r\n")):
        return json_error(400, "\"api_key\" must be a non-empty string on one line (the worker's own key)",
                          param="api_key", code="invalid_api_key")
    kind = body.get("worker_type", "regular")
    if kind != "regular":
        return json_error(400, f"worker_type {kind!r} is not supported: only \"regular\" (no prefill/decode split)",
                          param="worker_type", code="unsupported_field")
    try:
        url = normalize_url(raw)
    except ValueError as e:
        return json_error(400, f"bad worker url: {e}", param="url", code="invalid_worker_url")
    if router.registry.get(url) is not None:
        return json_error(409, f"worker {url} is already registered", "conflict_error", param="url",
                          code="worker_already_exists")
    if router.cfg.disable_health_check:
        router.registry.add(router.new_worker(url, key))
        admin.log.info("added worker %s (health checks off)", url)
        message = f"added worker {url}"
    else:
        admin.begin_add(router, url, key)
        message = (f"worker {url} is added once {router.cfg.health_check_endpoint} answers "
                   f"(waiting up to {router.cfg.worker_startup_timeout_secs:g} s)")
    location = _location(url)
    return Response(202, orjson.dumps({"status": "accepted", "worker_id": url, "url": url, "location": location,
                                       "message": message}), headers=[("Location", location)])


async def handle_delete(router: Router, request: Request) -> Response:
    try:
        url = _url_of(request)
    except ValueError as e:
        return json_error(400, f"bad worker url: {e}", param="url", code="invalid_worker_url")
    message = admin.remove(router, url)
    if message is None:
        return json_error(404, f"worker {url} is not registered", "not_found_error", param="url",
                          code="worker_not_found")
    return Response(200, orjson.dumps({"success": True, "status": "removed", "worker_id": url, "message": message}))
