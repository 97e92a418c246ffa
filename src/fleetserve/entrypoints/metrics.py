"""Prometheus metrics of one engine instance (``GET /metrics``).

Names follow SGLang's ``sglang:*`` metrics with our prefix:

* gauges (from the schedulers' :class:`~fleetserve.engine.io_struct.SchedulerStats`,
  summed over DP ranks): ``fleetserve:num_running_reqs``,
  ``fleetserve:num_waiting_reqs``, ``fleetserve:kv_used_tokens``,
  ``fleetserve:kv_pool_size``, ``fleetserve:token_usage`` (used / pool, 0..1),
  ``fleetserve:cache_hit_rate`` (cached prompt tokens / prompt tokens since start, 0..1);
* counters (counted in the HTTP process as requests finish):
  ``fleetserve:prompt_tokens_total``, ``fleetserve:generation_tokens_total``,
  ``fleetserve:cached_tokens_total``, ``fleetserve:num_requests_total``;
* counters of KV-cache event batches (``--kv-events-config``), from the
  schedulers' stats summed over DP ranks: ``fleetserve:kv_events_published_total``,
  ``fleetserve:kv_events_dropped_total`` (lost to a full publisher queue);
* histograms (seconds): ``fleetserve:time_to_first_token_seconds`` (TTFT),
  ``fleetserve:inter_token_latency_seconds`` (ITL, one observation per token
  after the first, spread evenly over a message that carried several tokens),
  ``fleetserve:e2e_request_latency_seconds``.

The same scheduler figures also appear under SGLang's and vLLM's names
(``sglang:num_running_reqs``, ``vllm:num_requests_waiting``, ...; one series
per DP rank), listed in :mod:`fleetserve.entrypoints.metrics_compat`.

Each :class:`EngineMetrics` owns its own ``CollectorRegistry`` so several apps
can live in one process (tests).
"""

from __future__ import annotations

from typing import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

from fleetserve.engine.io_struct import SchedulerStats
from fleetserve.entrypoints.metrics_compat import PeerMetricsCollector

# Bucket edges in seconds; CPU serving is slow, so they reach further than a GPU's.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class EngineMetrics:
    """All metrics of one instance, labelled with the served model name."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        lab = ["model_name"]
        r = self.registry
        self.num_running = Gauge("fleetserve:num_running_reqs", "Requests decoding or prefilling now", lab, registry=r)
        self.num_waiting = Gauge("fleetserve:num_waiting_reqs", "Requests queued, not yet admitted", lab, registry=r)
        self.kv_used = Gauge("fleetserve:kv_used_tokens", "KV slots held by running requests", lab, registry=r)
        self.kv_pool = Gauge("fleetserve:kv_pool_size", "KV pool size in tokens", lab, registry=r)
        self.kv_cached = Gauge("fleetserve:kv_cached_tokens", "KV slots held only by the radix cache", lab, registry=r)
        self.token_usage = Gauge("fleetserve:token_usage", "KV usage: used / pool size (0..1)", lab, registry=r)
        self.cache_hit_rate = Gauge(
            "fleetserve:cache_hit_rate", "Prompt tokens served from the radix cache / prompt tokens (0..1)", lab, registry=r
        )
        self.prompt_tokens = Counter("fleetserve:prompt_tokens", "Prompt tokens of finished requests", lab, registry=r)
        self.generation_tokens = Counter("fleetserve:generation_tokens", "Generated tokens", lab, registry=r)
        self.cached_tokens = Counter("fleetserve:cached_tokens", "Prompt tokens served from the radix cache", lab, registry=r)
        self.num_requests = Counter("fleetserve:num_requests", "Finished requests", lab, registry=r)
        self.kv_events_published = Counter("fleetserve:kv_events_published", "KV-event batches published",
                                           lab, registry=r)
        self.kv_events_dropped = Counter("fleetserve:kv_events_dropped",
                                         "KV-event batches dropped on a full publisher queue", lab, registry=r)
        self._kv_events_seen = {"kv_events_published": 0, "kv_events_dropped": 0}
        self.ttft = Histogram(
            "fleetserve:time_to_first_token_seconds", "Time to first token (TTFT)", lab, buckets=TTFT_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "fleetserve:inter_token_latency_seconds", "Inter-token latency (ITL)", lab, buckets=ITL_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "fleetserve:e2e_request_latency_seconds", "End-to-end request latency", lab, buckets=E2E_BUCKETS, registry=r
        )
        self.ranks: list[SchedulerStats] = []  # latest stats per DP rank, for the SGLang / vLLM names
        r.register(PeerMetricsCollector(model_name, lambda: self.ranks))

    def _l(self, metric):
        return metric.labels(model_name=self.model_name)

    def set_stats(self, stats: Iterable[SchedulerStats]) -> dict[str, float]:
        """Set the gauges from the latest stats of every DP rank; return the summed values."""
        stats = list(stats)
        self.ranks = stats
        total = {
            "num_running_reqs": sum(s.num_running_reqs for s in stats),
            "num_waiting_reqs": sum(s.num_waiting_reqs for s in stats),
            "kv_pool_size": sum(s.kv_pool_size for s in stats),
            "kv_used_tokens": sum(s.kv_used_tokens for s in stats),
            "kv_cached_tokens": sum(s.kv_cached_tokens for s in stats),
            "prompt_tokens_total": sum(s.prompt_tokens_total for s in stats),
            "generation_tokens_total": sum(s.generation_tokens_total for s in stats),
            "cached_prompt_tokens_total": sum(s.cached_prompt_tokens_total for s in stats),
            "kv_events_published": sum(getattr(s, "kv_events_published", 0) for s in stats),
            "kv_events_dropped": sum(getattr(s, "kv_events_dropped", 0) for s in stats),
        }
        total["token_usage"] = total["kv_used_tokens"] / total["kv_pool_size"] if total["kv_pool_size"] else 0.0
        total["cache_hit_rate"] = (
            total["cached_prompt_tokens_total"] / total["prompt_tokens_total"] if total["prompt_tokens_total"] else 0.0
        )
        self._l(self.num_running).set(total["num_running_reqs"])
        self._l(self.num_waiting).set(total["num_waiting_reqs"])
        self._l(self.kv_used).set(total["kv_used_tokens"])
        self._l(self.kv_pool).set(total["kv_pool_size"])
        self._l(self.kv_cached).set(total["kv_cached_tokens"])
        self._l(self.token_usage).set(total["token_usage"])
        self._l(self.cache_hit_rate).set(total["cache_hit_rate"])
        for key, counter in (("kv_events_published", self.kv_events_published),
                             ("kv_events_dropped", self.kv_events_dropped)):
            child = self._l(counter)  # shown (as 0) from the first stats on
            grew = total[key] - self._kv_events_seen[key]  # the schedulers count; the counter follows
            if grew > 0:
                child.inc(grew)
                self._kv_events_seen[key] = total[key]
        return total

    def observe_first_token(self, seconds: float) -> None:
        self._l(self.ttft).observe(max(0.0, seconds))

    def observe_tokens(self, n_tokens: int, seconds: float) -> None:
        """``n_tokens`` later tokens arrived ``seconds`` after the previous message."""
        if n_tokens <= 0:
            return
        per = max(0.0, seconds) / n_tokens
        h = self._l(self.itl)
        for _ in range(n_tokens):
            h.observe(per)

    def observe_finished(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int, e2e_seconds: float) -> None:
        self._l(self.prompt_tokens).inc(prompt_tokens)
        self._l(self.generation_tokens).inc(completion_tokens)
        self._l(self.cached_tokens).inc(cached_tokens)
        self._l(self.num_requests).inc()
        self._l(self.e2e).observe(max(0.0, e2e_seconds))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
