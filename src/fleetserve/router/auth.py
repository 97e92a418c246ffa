"""The router's own ``--api-key``.

As in sglang-router 0.3.2 (checked by running it): with ``--api-key K`` the
inference routes and the admin routes answer 401 unless the request carries
``Authorization: Bearer K``; the probes stay open.  Only the ``Bearer`` form
counts (sglang-router refuses ``X-Api-Key`` too).  Our 401 is an
OpenAI-style JSON error with ``WWW-Authenticate: Bearer`` (sglang-router's
has an empty body).

Open with a key: ``/health``, ``/liveness``, ``/readiness``,
``/health_generate``, ``/metrics`` (and the ``--prometheus-port`` listener),
and the info routes ``/v1/models``, ``/get_model_info``,
``/get_server_info``, which sglang-router 0.3.2 leaves open too.

The key is not injected into requests to the workers: the client's own
credential headers are passed on, as without ``--api-key``
(:data:`.proxy.CREDENTIAL_HEADERS`).  A client admitted by the router sent
``Bearer K``, so workers started with the same key (sglang-router's
one-key set-up) accept it, and workers without a key ignore it.
"""

from __future__ import annotations

import hmac

from .http.server import Request, Response, json_error

# paths that need no key even with --api-key
OPEN_PATHS = frozenset({"/health", "/liveness", "/readiness", "/health_generate", "/metrics",
                        "/v1/models", "/get_model_info", "/get_server_info"})


def _unauthorized(message: str) -> Response:
    resp = json_error(401, message, "authentication_error", code="invalid_api_key")
    resp.headers = [("WWW-Authenticate", "Bearer")]
    return resp


def check(api_key: str, request: Request) -> Response | None:
    """``None`` if ``request`` carries ``Authorization: Bearer <api_key>``, else the 401 to send.

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
