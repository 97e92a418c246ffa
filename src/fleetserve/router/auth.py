"""The router's own ``--api-key``.

As in sglang-router 0.3.2 (checked by running it): with ``--api-key K`` the
inference routes and the admin routes answer 401 unless the request carries
``Authorization: Bearer K``; the probes stay open.  Only the ``Bearer`` form
counts (sglang-router refuses ``X-Api-Key`` too).  Our 401 is an
OpenAI-style JSON error with ``WWW-Authenticate: Bearer`` (sglang-router's
has an empty body).

Open with a key: ``/health``, ``/liveness``, ``/readiness``,
``/health_generate``, ``/metrics`` (and the ``--prometheus-port`` listener),
``/version`` (open on the engine too),
and the info routes ``/v1/models``, ``/get_model_info``,
``/get_server_info``, which sglang-router 0.3.2 leaves open too, and
``/v1/models/{model_id}``, open as ``/v1/models`` is.

The key is also the workers' key, as sglang-router's ``--api-key`` ("the api
key used for the authorization with the worker"): it builds each startup
worker's config with the router's key (``Job::InitializeWorkersFromConfig``)
and sends ``Authorization: Bearer <key>`` on its own requests to the worker
(``/get_server_info`` at registration, ``/get_load``, ``/flush_cache``) and on
proxied requests.  Here every request the router makes itself carries it
(:func:`worker_headers`, the control session's default header): the health
checks, kv_aware's ``/get_server_info`` and ``/v1/loads``, ``/get_load``, and
the proxied info routes and ``/flush_cache`` fan-out unless the client sent its
own ``Authorization``, which is passed on instead
(:data:`CREDENTIAL_HEADERS`).  Proxied inference needs the client's
``Bearer K`` to get past :func:`check`, so it already carries the key.  So
engines started with the same ``--api-key`` (sglang-router's one-key set-up)
serve behind it, and workers without a key ignore the header.

A worker registered with a key of its own (``POST /workers {"url", "api_key"}``,
smg's ``WorkerConfigRequest.api_key``) gets that key instead, as smg sends it:
on the router's own requests to it (:func:`own_headers`) and on every request
passed on to it, in place of the client's credentials (:func:`for_worker`,
:func:`swap_credential_lines`).  The key is never shown by ``GET /workers``.
"""

from __future__ import annotations

import hmac

from .http.server import Request, Response, json_error

# request headers that carry the client's credentials for the worker: passed on by every proxied route
# (inference in proxy.py; info and /flush_cache in admin.py).  OpenAI's ``Authorization: Bearer``, and the
# ``x-api-key`` / ``api-key`` forms some clients send.
CREDENTIAL_HEADERS = ("authorization", "x-api-key", "api-key")

# paths that need no key even with --api-key
OPEN_PATHS = frozenset({"/health", "/liveness", "/readiness", "/health_generate", "/metrics", "/version",
                        "/v1/models", "/get_model_info", "/get_server_info"})
# path prefixes that need no key either: /v1/models/{model_id}, open as /v1/models is
OPEN_PREFIXES = ("/v1/models/",)


def worker_headers(api_key: str | None) -> dict[str, str]:
    """The headers the router's own requests to the workers carry: ``{"Authorization": "Bearer <key>"}``
    with ``--api-key``, else none."""
    return {"Authorization": f"Bearer {api_key}"} if api_key is not None else {}


def own_headers(worker_key: str | None) -> dict[str, str]:
    """The per-request headers of the router's own request to a worker registered with its own key
    (``POST /workers {"api_key": K}``): ``{"Authorization": "Bearer K"}``, which replaces the
    control session's ``--api-key`` default; ``{}`` (the default applies) when it has none."""
    return {"Authorization": f"Bearer {worker_key}"} if worker_key is not None else {}


def for_worker(worker_key: str | None, creds: dict[str, str]) -> dict[str, str]:
    """The credential headers a passed-on request (info routes, ``/flush_cache``, ``/get_load``) carries
    to one worker: the worker's own key if it was registered with one (the client's credentials were
    the router's, smg does the same), else the client's ``creds`` as they came."""
    return own_headers(worker_key) if worker_key is not None else creds


def swap_credential_lines(lines: bytes, worker_key: str) -> bytes:
    """Raw ``name: value\\r\\n`` request-header ``lines`` with the client's credential headers taken out
    and ``authorization: Bearer <worker_key>`` put in: a proxied request to a worker registered with its
    own key (smg sets that worker's key as the upstream ``Authorization``)."""
    kept = [ln for ln in lines.split(b"\r\n") if ln and
            ln.split(b":", 1)[0].strip().lower().decode("latin-1") not in CREDENTIAL_HEADERS]
    kept.append(b"authorization: Bearer " + worker_key.encode("latin-1"))
    return b"".join(ln + b"\r\n" for ln in kept)


def _unauthorized(message: str) -> Response:
    resp = json_error(401, message, "authentication_error", code="invalid_api_key")
    resp.headers = [("WWW-Authenticate", "Bearer")]
    return resp


def check(api_key: str, request: Request) -> Response | None:
    """``None`` if ``request`` carries ``Authorization: Bearer <api_key>``, else the 401 to send.

    The scheme is matched in any case (``bearer``, ``BEARER``): RFC 7235 section 2.1 makes auth
    schemes case-insensitive.

    The comparison takes the same time whatever the key's first wrong byte
    (``hmac.compare_digest``).
    """
    header = request.headers.get("authorization")
    if header is None:
        return _unauthorized("missing API key: send 'Authorization: Bearer <key>'")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        return _unauthorized("invalid API key")
    return None


def guard(api_key: str | None, handler):
    """``handler`` behind the key check; ``handler`` itself when there is no key."""
    if api_key is None:
        return handler

    async def guarded(request: Request):
        denied = check(api_key, request)
        if denied is not None:
            return denied
        return await handler(request)

    return guarded
