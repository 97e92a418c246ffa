"""How the worker routes (``/list_workers``, ``/workers``) describe one worker.

A worker is shown healthy only while all three hold: its health checks pass,
its circuit breaker is not open, and its last proxied attempt did not fail by
its fault.  The health checks alone run every 60 s and need 3 failures in a
row (sglang-router's defaults), so a dead worker would stay "healthy" there
for about 3 minutes; the failed attempts show it at once.  Routing does not
read this: it goes by :meth:`.workers.Worker.available` as before.

``status`` takes smg's worker status words: ``ready`` (healthy as above and
not draining), ``not_ready``, ``draining``, and ``pending`` for an
``/add_worker`` / ``POST /workers`` url still waiting for its first good
health check.
"""

from __future__ import annotations

from .circuit_breaker import OPEN
from .workers import Worker

READY, NOT_READY, DRAINING, PENDING = "ready", "not_ready", "draining", "pending"


def is_healthy(w: Worker) -> bool:
    """Health checks passing, circuit not open, and no failed attempt since the last good one (a request
    that succeeded, or the health checks finding it healthy again after it was down: health.record_check)."""
    return w.healthy and w.breaker.state is not OPEN and w.failed_in_row == 0


def status(w: Worker) -> str:
    if w.draining:
        return DRAINING
    return READY if is_healthy(w) else NOT_READY


def describe(w: Worker) -> dict:
    """One worker as ``/list_workers`` and ``/workers`` show it.

    smg's field names where it has one (``id``, ``url``, ``worker_type``,
    ``connection_mode``, ``is_healthy``, ``status``, ``load``, ``model_id``:
    null, the router does not ask workers for it); then ours, each once:
    ``health_check`` (the health checks alone), ``circuit_breaker``
    (``closed`` / ``open`` / ``half_open``), ``consecutive_failures``
    (failed attempts since the last good one), ``requests`` / ``failures``
    (totals), ``draining``.  ``load`` is requests in flight through this
    router. (The duplicates ``healthy`` = ``is_healthy`` and ``circuit`` =
    ``circuit_breaker`` were dropped.)
    """
    healthy = is_healthy(w)
    return {
        "id": w.url, "url": w.url, "model_id": None, "worker_type": "regular", "connection_mode": "Http",
        "is_healthy": healthy, "status": status(w), "load": w.load,
        "health_check": w.healthy, "circuit_breaker": w.breaker.state,
        "consecutive_failures": w.failed_in_row, "requests": w.requests, "failures": w.failures,
        "draining": w.draining,
    }


def describe_pending(url: str) -> dict:
    """A url still waiting for its first good health check (not routed to yet)."""
    return {"id": url, "url": url, "model_id": None, "worker_type": "regular", "connection_mode": "Http",
            "is_healthy": False, "status": PENDING, "load": 0}
