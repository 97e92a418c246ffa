"""SGLang's and vLLM's Prometheus names for our schedulers' figures (``GET /metrics``).

Dashboards and routers built for SGLang or vLLM read these series; they carry
the same values as our ``fleetserve:*`` metrics, one series per DP rank, from
the latest :class:`~fleetserve.engine.io_struct.SchedulerStats` (refreshed
by every ``/metrics`` scrape).

SGLang (labels ``model_name``, ``engine_type="unified"``, ``tp_rank="0"``,
``dp_rank``; SGLang adds ``dp_rank`` only under DP attention, we always do):

=================================  =======  ==============================================
``sglang:num_running_reqs``        gauge    running requests
``sglang:num_queue_reqs``          gauge    waiting requests
``sglang:num_used_tokens``         gauge    KV slots held by running requests
``sglang:token_usage``             gauge    used / pool (0..1)
``sglang:cache_hit_rate``          gauge    cached prompt tokens / prompt tokens since start (0..1)
``sglang:gen_throughput``          gauge    tokens/s generated over the last 5 s
``sglang:prompt_tokens_total``     counter  prompt tokens admitted
``sglang:generation_tokens_total`` counter  tokens generated
``sglang:cached_tokens_total``     counter  prompt tokens served from the radix cache
=================================  =======  ==============================================

vLLM (labels ``model_name``, ``engine`` = the DP rank, vLLM's engine index):

====================================  =======  ===========================================
``vllm:num_requests_running``         gauge    running requests
``vllm:num_requests_waiting``         gauge    waiting requests
``vllm:kv_cache_usage_perc``          gauge    used / pool (0..1; vLLM: "1 means 100 percent")
``vllm:prefix_cache_queries_total``   counter  prompt tokens looked up in the prefix cache
``vllm:prefix_cache_hits_total``      counter  of those, tokens found there
``vllm:prompt_tokens_total``          counter  prompt tokens admitted
``vllm:generation_tokens_total``      counter  tokens generated
====================================  =======  ===========================================

Names checked against SGLang's ``python/sglang/srt/metrics/collector.py`` and
vLLM's ``vllm/v1/metrics/loggers.py`` (counters are declared without
``_total``; ``prometheus_client`` appends it on the wire).
"""

from __future__ import annotations

from typing import Callable, Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from fleetserve.engine.io_struct import SchedulerStats


def _usage(s: SchedulerStats) -> float:
    return s.kv_used_tokens / s.kv_pool_size if s.kv_pool_size else 0.0


def _hit_rate(s: SchedulerStats) -> float:
    return s.cached_prompt_tokens_total / s.prompt_tokens_total if s.prompt_tokens_total else 0.0


# (name, kind, help, value of one rank's stats)
SGLANG = (
    ("sglang:num_running_reqs", "gauge", "The number of running requests.", lambda s: s.num_running_reqs),
    ("sglang:num_queue_reqs", "gauge", "The number of requests in the waiting queue.", lambda s: s.num_waiting_reqs),
    ("sglang:num_used_tokens", "gauge", "The number of used tokens.", lambda s: s.kv_used_tokens),
    ("sglang:token_usage", "gauge", "The token usage.", _usage),
    ("sglang:cache_hit_rate", "gauge", "The prefix cache hit rate.", _hit_rate),
    ("sglang:gen_throughput", "gauge", "The generation throughput (token/s).", lambda s: s.gen_throughput),
    ("sglang:prompt_tokens", "counter", "Number of prefill tokens processed.", lambda s: s.prompt_tokens_total),
    ("sglang:generation_tokens", "counter", "Number of generation tokens processed.",
     lambda s: s.generation_tokens_total),
    ("sglang:cached_tokens", "counter", "Number of cached prompt tokens.", lambda s: s.cached_prompt_tokens_total),
)
VLLM = (
    ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
     lambda s: s.num_running_reqs),
    ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
     lambda s: s.num_waiting_reqs),
    ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", _usage),
    ("vllm:prefix_cache_queries", "counter", "Prefix cache queries, in terms of number of queried tokens.",
     lambda s: s.prompt_tokens_total),
    ("vllm:prefix_cache_hits", "counter", "Prefix cache hits, in terms of number of cached tokens.",
     lambda s: s.cached_prompt_tokens_total),
    ("vllm:prompt_tokens", "counter", "Number of prefill tokens processed.", lambda s: s.prompt_tokens_total),
    ("vllm:generation_tokens", "counter", "Number of generation tokens processed.",
     lambda s: s.generation_tokens_total),
)


class PeerMetricsCollector:
    """A ``prometheus_client`` collector yielding :data:`SGLANG` and :data:`VLLM` per DP rank.

    Args:
        model_name: the ``model_name`` label.
        latest: returns the latest stats of every DP rank.
    """

    def __init__(self, model_name: str, latest: Callable[[], Iterable[SchedulerStats]]):
        self.model_name = model_name
        self.latest = latest

    def collect(self):
        stats = sorted(self.latest(), key=lambda s: s.dp_rank)
        families = [(SGLANG, ["model_name", "engine_type", "tp_rank", "dp_rank"],
                     lambda s: [self.model_name, "unified", "0", str(s.dp_rank)]),
                    (VLLM, ["model_name", "engine"], lambda s: [self.model_name, str(s.dp_rank)])]
        for table, labels, values in families:
            for name, kind, doc, get in table:
                fam = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(name, doc, labels=labels)
                for s in stats:
                    fam.add_metric(values(s), float(get(s)))
                yield fam
