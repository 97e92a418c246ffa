"""Prometheus metrics of the router, collected at scrape time.

The request path only bumps plain integers (``Worker.requests``,
``Worker.failures``, ``RouterStats``) and one bucket counter; this collector
turns them into Prometheus families when ``/metrics`` is scraped, so no
prometheus-client lock is taken per request.

Families (prefix ``fleetserve_router_``):

* ``requests_total{worker}``: upstream attempts sent to each worker.
* ``failures_total{worker}``: attempts that failed by the worker's fault
  (connection error, timeout, 5xx other than a busy 503).
* ``retries_total``: attempts after the first.
* ``request_faults_total``: requests that two workers both answered with a 5xx status, so taken as
  the request's fault: neither worker's failure counted, no further retry (``proxy._forward``).
* ``migrations_total``: continuations that streamed, for streams whose worker failed mid-stream.
* ``inflight_requests{worker}``: the load used for routing.
* ``worker_healthy{worker}``: 1 healthy, 0 not, as ``/list_workers``' ``is_healthy`` says (health checks
  passing, circuit not open, no failed attempt since the last good one: :func:`.worker_view.is_healthy`).
* ``tree_size_chars{worker}``: characters the cache_aware tree holds for each worker.
* ``cache_decisions_total{result}``: cache_aware ``hit`` / ``miss`` / ``balanced``.
* ``routing_decision_seconds``: histogram of the time to choose a worker.
* with ``--sticky-sessions``: ``sticky_sessions`` (sessions remembered) and
  ``sticky_decisions_total{result=hit|new|moved}``.
* ``cache_prediction_abs_error_tokens{worker}`` (histogram), ``cache_predicted_tokens_total``,
  ``cache_reported_tokens_total``, ``cache_unreported_total``: the cache policies' predicted vs.
  engine-reported cached tokens (see :mod:`.prediction`).
* ``kv_*``: ``kv_aware``'s streams, index and loads (see :mod:`.kv_events.metrics`).
"""

from __future__ import annotations

import bisect

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from .worker_view import is_healthy

DECISION_BUCKETS_S = (5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3, 2.5e-2)


class RouterStats:
    """Plain counters bumped on the request path."""

    __slots__ = ("retries", "request_faults", "migrations", "no_worker", "bad_requests", "decision_counts",
                 "decision_sum")

    def __init__(self) -> None:
        self.retries = 0
        self.request_faults = 0
        self.migrations = 0
        self.no_worker = 0
        self.bad_requests = 0
        self.decision_counts = [0] * (len(DECISION_BUCKETS_S) + 1)
        self.decision_sum = 0.0

    def observe_decision(self, seconds: float) -> None:
        self.decision_counts[bisect.bisect_left(DECISION_BUCKETS_S, seconds)] += 1
        self.decision_sum += seconds


class RouterCollector:
    """prometheus-client custom collector reading a router's live state."""

    def __init__(self, router) -> None:
        self.router = router

    def collect(self):
        r = self.router
        workers = list(r.registry.workers)
        req = CounterMetricFamily("fleetserve_router_requests", "Upstream attempts per worker", labels=["worker"])
        fail = CounterMetricFamily("fleetserve_router_failures", "Failed upstream attempts per worker",
                                   labels=["worker"])
        infl = GaugeMetricFamily("fleetserve_router_inflight_requests", "Requests in flight per worker",
                                 labels=["worker"])
        healthy = GaugeMetricFamily("fleetserve_router_worker_healthy", "1 if the worker is healthy",
                                    labels=["worker"])
        tree = GaugeMetricFamily("fleetserve_router_tree_size_chars", "Characters in the routing tree per worker",
                                 labels=["worker"])
        policy = r.policy
        ptree = getattr(policy, "tree", None)
        for w in workers:
            req.add_metric([w.url], w.requests)
            fail.add_metric([w.url], w.failures)
            infl.add_metric([w.url], w.load)
            healthy.add_metric([w.url], 1 if is_healthy(w) else 0)
            tree.add_metric([w.url], ptree.tenant_size(w.url) if ptree is not None else 0)
        yield from (req, fail, infl, healthy, tree)
        yield CounterMetricFamily("fleetserve_router_retries", "Upstream attempts after the first",
                                  value=r.stats.retries)
        yield CounterMetricFamily("fleetserve_router_request_faults",
                                  "Requests two workers both answered with a 5xx status (the request's fault, "
                                  "not counted against either worker)", value=r.stats.request_faults)
        yield CounterMetricFamily("fleetserve_router_migrations", "Streams continued on another worker after a "
                                  "mid-stream failure (continuations that streamed)", value=r.stats.migrations)
        yield CounterMetricFamily("fleetserve_router_no_worker", "Requests answered 503: no available worker",
                                  value=r.stats.no_worker)
        yield CounterMetricFamily("fleetserve_router_bad_requests", "Requests answered 400: body not a JSON object",
                                  value=r.stats.bad_requests)
        dec = CounterMetricFamily("fleetserve_router_cache_decisions", "cache_aware decisions", labels=["result"])
        for label, attr in (("hit", "hits"), ("miss", "misses"), ("balanced", "balanced")):
            dec.add_metric([label], getattr(policy, attr, 0))
        yield dec
        sessions = getattr(r, "sessions", None)
        if sessions is not None:
            yield GaugeMetricFamily("fleetserve_router_sticky_sessions", "Sessions remembered (--sticky-sessions)",
                                    value=len(sessions))
            sd = CounterMetricFamily("fleetserve_router_sticky_decisions", "Keyed requests: the session's worker "
                                     "took it (hit), an unknown key (new), or the session moved (moved)",
                                     labels=["result"])
            for label, attr in (("hit", "hits"), ("new", "new"), ("moved", "moved")):
                sd.add_metric([label], getattr(sessions, attr))
            yield sd
        preds = getattr(r, "predictions", None)
        if preds is not None:  # predicted vs engine-reported cached tokens (prediction.py)
            from .prediction import families as prediction_families
            yield from prediction_families(preds)
        if getattr(policy, "index", None) is not None:  # kv_aware: its streams, index and loads
            from .kv_events.metrics import families
            yield from families(policy)
        counts = r.stats.decision_counts
        buckets, acc = [], 0
        for bound, c in zip(DECISION_BUCKETS_S, counts):
            acc += c
            buckets.append((repr(bound), acc))
        acc += counts[-1]
        buckets.append(("+Inf", acc))
        yield HistogramMetricFamily("fleetserve_router_routing_decision_seconds", "Time to choose a worker",
                                    buckets=buckets, sum_value=r.stats.decision_sum)


def make_registry(router) -> CollectorRegistry:
    """A fresh registry holding only this router's collector."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(RouterCollector(router))
    from .admission_metrics import AdmissionCollector
    reg.register(AdmissionCollector(router))
    return reg


def render(registry: CollectorRegistry) -> bytes:
    """Prometheus text exposition of ``registry``."""
    return generate_latest(registry)
