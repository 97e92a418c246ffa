"""``create_app``: the FastAPI app of ``fleetserve serve`` over a :class:`TokenizerManager`."""

from __future__ import annotations

from typing import Any, Callable

from fastapi import FastAPI

from fleetserve.entrypoints.http import admin, chat, completions, loads, native
from fleetserve.entrypoints.http.auth import APIKeyMiddleware
from fleetserve.entrypoints.http.errors import install_error_handlers
from fleetserve.entrypoints.http.lifespan import lifespan
from fleetserve.entrypoints.http.state import DEFAULT_MAX_REQUEST_BYTES, ServerState
from fleetserve.entrypoints.tokenizer_manager import TokenizerManager

ROUTERS = (admin.router, loads.router, native.router, completions.router, chat.router)


def create_app(
    tm: TokenizerManager,
    server_args: dict[str, Any] | None = None,
    api_key: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    is_alive: Callable[[], bool] | None = None,
) -> FastAPI:
    """Build the FastAPI app; its routes are listed in :mod:`fleetserve.entrypoints.http`.

    Args:
        tm: the tokenizer manager (its receive loop is started on app start-up).
        server_args: reported by ``/get_server_info``.
        api_key: when set, every route but ``/health`` and ``/metrics`` needs
            ``Authorization: Bearer <api_key>`` (else 401).
        max_request_bytes: larger bodies get 413.
        is_alive: reports whether the scheduler process(es) still run (``/health``;
            when it turns False, running requests end with an abort and new ones get 503).

    Returns:
        the app, with its :class:`ServerState` on ``app.state.server``.
    """
    app = FastAPI(title="fleetserve engine", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.server = ServerState(tm=tm, server_args=dict(server_args or {}), api_key=api_key,
                                   max_request_bytes=max_request_bytes, is_alive=is_alive)
    install_error_handlers(app)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    for router in ROUTERS:
        app.include_router(router)
    return app
