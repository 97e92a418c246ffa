"""The API key check: ``Authorization: Bearer <key>`` on every route but the probes."""

from __future__ import annotations

from typing import Any, Callable

from fleetserve.entrypoints.errors import APIError
from fleetserve.entrypoints.http.errors import error_response

# Paths answered without an API key (probes and scrapers; /version as in vLLM, whose key guards /v1 only).
OPEN_PATHS = {"/health", "/metrics", "/version"}


class APIKeyMiddleware:
    """Pure ASGI middleware: 401 unless ``Authorization: Bearer <api_key>`` (``OPEN_PATHS`` exempt).

    Written as plain ASGI (not ``BaseHTTPMiddleware``) so that request bodies and
    client disconnects reach the routes untouched.
    """

    def __init__(self, app: Any, api_key: str):
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope.get("path") in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        header = ""
        for k, v in scope.get("headers", []):
            if k == b"authorization":
                header = v.decode("latin-1")
                break
        scheme, _, token = header.partition(" ")
        if scheme.lower() == "bearer" and token.strip() == self.api_key:
            await self.app(scope, receive, send)
            return
        what = "missing" if not header else "wrong"
        resp = error_response(APIError(f"{what} API key: send 'Authorization: Bearer <key>'", 401, None,
                                       "invalid_api_key"))
        await resp(scope, receive, send)
