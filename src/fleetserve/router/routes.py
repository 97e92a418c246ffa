"""The route tables: which handler answers which method and path.

:func:`make_routes` is the router's main port; :func:`metrics_routes` is the
``--prometheus-port`` one (``GET /metrics`` only).  Handlers are module-level
functions over the :class:`~.app.Router`, bound to it here.
"""

from __future__ import annotations

from functools import partial

from . import admin, proxy
from .app import Router
from .http.server import Routes


def make_routes(router: Router) -> Routes:
    routes = Routes()
    for path in proxy.INFERENCE_PATHS:
        routes.add("POST", path, partial(proxy.handle_inference, router))
    for path in admin.INFO_PATHS:
        routes.add("GET", path, partial(admin.handle_info, router))
    routes.add("POST", "/flush_cache", partial(admin.handle_flush_cache, router))
    routes.add("GET", "/health", partial(admin.handle_health, router))
    routes.add("GET", "/readiness", partial(admin.handle_readiness, router))
    routes.add("GET", "/metrics", partial(admin.handle_metrics, router))
    routes.add("POST", "/add_worker", partial(admin.handle_add_worker, router))
    routes.add("POST", "/remove_worker", partial(admin.handle_remove_worker, router))
    routes.add("GET", "/list_workers", partial(admin.handle_list_workers, router))
    return routes


def metrics_routes(router: Router) -> Routes:
    routes = Routes()
    routes.add("GET", "/metrics", partial(admin.handle_metrics, router))
    return routes
