"""The route tables: which handler answers which method and path.

:func:`make_routes` is the router's main port; :func:`metrics_routes` is the
``--prometheus-port`` one (``GET /metrics`` only).  Handlers are module-level
functions over the :class:`~.app.Router`, bound to it here; with ``--api-key``
every path outside :data:`.auth.OPEN_PATHS` (and
:data:`.auth.OPEN_PREFIXES`) is behind the key check.
"""

from __future__ import annotations

from functools import partial

from . import admin, auth, drain, probes, proxy, workers_api
from .app import Router
from .http.server import Routes


def make_routes(router: Router) -> Routes:
    routes = Routes()
    key = router.cfg.api_key

    def add(method: str, path: str, handler) -> None:
        bound = partial(handler, router)
        routes.add(method, path, bound if path in auth.OPEN_PATHS else auth.guard(key, bound))

    def add_prefix(method: str, prefix: str, handler) -> None:
        bound = partial(handler, router)
        routes.add_prefix(method, prefix, bound if prefix in auth.OPEN_PREFIXES else auth.guard(key, bound))

    for path in proxy.INFERENCE_PATHS:
        add("POST", path, proxy.handle_inference)
    for path in admin.INFO_PATHS:
        add("GET", path, admin.handle_info)
    add("POST", "/flush_cache", admin.handle_flush_cache)
    add("GET", "/health", admin.handle_health)
    add("GET", "/version", admin.handle_version)
    add("GET", "/liveness", probes.handle_liveness)
    add("GET", "/readiness", admin.handle_readiness)
    add("GET", "/health_generate", probes.handle_health_generate)
    add("GET", "/get_loads", probes.handle_get_loads)
    add("GET", "/metrics", admin.handle_metrics)
    add("POST", "/add_worker", admin.handle_add_worker)
    add("POST", "/remove_worker", admin.handle_remove_worker)
    add("POST", "/drain_worker", drain.handle_drain_worker)
    add("GET", "/list_workers", admin.handle_list_workers)
    add("GET", "/workers", workers_api.handle_list)  # smg's worker REST routes (workers_api.py)
    add("POST", "/workers", workers_api.handle_create)
    add_prefix("GET", admin.MODEL_PREFIX, admin.handle_info)  # /v1/models/{model_id}, open as /v1/models
    add_prefix("GET", workers_api.PREFIX, workers_api.handle_get)
    add_prefix("DELETE", workers_api.PREFIX, workers_api.handle_delete)
    return routes


def metrics_routes(router: Router) -> Routes:
    routes = Routes()
    routes.add("GET", "/metrics", partial(admin.handle_metrics, router))
    return routes
