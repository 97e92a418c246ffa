"""Prometheus families of admission control (:mod:`.admission`), read at scrape time.

Families (prefix ``fleetserve_router_``), all present with zeros when
``--max-concurrent-requests`` is off:

* ``queue_length``: requests waiting for admission now (gauge).
* ``admitted_requests``: requests holding an admission token now (gauge).
* ``queue_wait_seconds``: histogram of the time admitted requests waited
  (0 for those admitted at once).
* ``rejections_total{reason}``: ``queue_full`` (429), ``queue_timeout``
  (408), ``client_disconnected`` (left the queue).
* ``rate_limit_total{result}``: ``allowed`` / ``rejected``, as smg's
  ``smg_http_rate_limit_total``.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from .admission import QUEUE_WAIT_BUCKETS_S, REJECT_REASONS


class AdmissionCollector:
    """prometheus-client custom collector over ``router.admission`` (``None`` = off)."""

    def __init__(self, router) -> None:
        self.router = router

    def collect(self):
        a = self.router.admission
        yield GaugeMetricFamily("fleetserve_router_queue_length", "Requests waiting for admission",
                                value=a.queued if a else 0)
        yield GaugeMetricFamily("fleetserve_router_admitted_requests", "Requests holding an admission token",
                                value=a.admitted if a else 0)
        counts = a.wait_counts if a else [0] * (len(QUEUE_WAIT_BUCKETS_S) + 1)
        buckets, acc = [], 0
        for bound, c in zip(QUEUE_WAIT_BUCKETS_S, counts):
            acc += c
            buckets.append((repr(bound), acc))
        buckets.append(("+Inf", acc + counts[-1]))
        yield HistogramMetricFamily("fleetserve_router_queue_wait_seconds", "Time admitted requests waited",
                                    buckets=buckets, sum_value=a.wait_sum if a else 0.0)
        rej = CounterMetricFamily("fleetserve_router_rejections", "Requests refused by admission control",
                                  labels=["reason"])
        for reason in REJECT_REASONS:
            rej.add_metric([reason], a.rejected[reason] if a else 0)
        yield rej
        rl = CounterMetricFamily("fleetserve_router_rate_limit", "Admission decisions", labels=["result"])
        rl.add_metric(["allowed"], a.allowed_total if a else 0)
        rl.add_metric(["rejected"], sum(a.rejected.values()) if a else 0)
        yield rl
