"""Per-DP-rank load in SGLang's shapes: the bodies of ``GET /v1/loads`` and ``GET /get_load``.

Built from the schedulers' :class:`~fleetserve.engine.io_struct.SchedulerStats`,
which each scheduler computes from its running batch, waiting queue, KV pool
and radix cache when asked (so a figure is at most one scheduler step old).

One ``/v1/loads`` entry per DP rank (SGLang's ``GetLoadsReqOutput`` core fields):

========================================  ==========================================================
``dp_rank``                               the DP rank (int)
``timestamp``                             when the rank's scheduler took these figures: ``time.time()``,
                                          seconds since the epoch (float; SGLang's field, set where
                                          SGLang sets it, in the scheduler)
``num_running_reqs``                      requests holding KV and decoding or prefilling (the chunked
                                          prefill counts here; SGLang counts it in neither list)
``num_waiting_reqs``                      requests queued, not yet admitted (retracted ones too)
``num_total_reqs``                        running + waiting (SGLang's older field)
``num_waiting_uncached_tokens``           prefill work still ahead (:mod:`fleetserve.engine.load_report`)
``num_used_tokens``                       KV slots held by running requests
``num_total_tokens``                      ``num_used_tokens`` + the waiting requests' lengths (+ the
                                          chunked request's uncomputed tokens)
``max_total_num_tokens``                  KV pool size in tokens
``max_running_requests``                  ``--max-running-requests`` (or the default)
``token_usage``                           ``num_used_tokens / max_total_num_tokens``, 4 decimals
``gen_throughput``                        tokens/s generated over the last 5 s, 2 decimals
``prefill_throughput``                    uncached prompt tokens/s admitted to prefill over the last
                                          5 s, 2 decimals (SGLang's newer field)
``cache_hit_rate``                        prompt tokens served from the radix cache / prompt tokens,
                                          since start, 4 decimals (SGLang: over recent prefills)
``utilization``                           always 0.0: SGLang's field, which SGLang itself leaves at 0
========================================  ==========================================================

SGLang's optional sections of an entry (``memory``, ``speculative``, ``lora``,
``disaggregation``, ``queues``, asked for with ``include``) are not given: we have no figures
for them, and SGLang leaves a section out (None) when it has none.

The body's top level has SGLang's ``timestamp`` (UTC ISO 8601), ``version``,
``dp_rank_count``, ``accelerator`` (None: not known to the HTTP process),
``num_accelerators`` (devices behind one DP rank), ``loads`` and the
``aggregate`` totals of SGLang's older releases (``total_running_reqs``,
``total_waiting_reqs``, ``total_reqs``, ``avg_token_usage``, ``avg_throughput``,
``avg_utilization``) plus ``total_waiting_uncached_tokens``,
``total_used_tokens`` and ``total_tokens``.

``/get_load`` is SGLang's older list: per rank ``dp_rank``, ``num_reqs``
(running + waiting), ``num_waiting_reqs``, ``num_tokens`` (= ``num_total_tokens``),
``num_pending_tokens`` (``num_total_tokens - num_used_tokens``) and ``ts_tic``
(``time.perf_counter()`` of this process).
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Iterable, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from fleetserve.engine.io_struct import SchedulerStats
from fleetserve.entrypoints.version import PACKAGE_VERSION

# SGLang's GetLoadsReqInput.VALID_SECTIONS; only "core" has figures here.
VALID_SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})

# Numeric per-rank fields exported by ``format=prometheus`` as ``sglang_<field>{dp_rank="d"}`` gauges.
PROMETHEUS_FIELDS = {
    "num_running_reqs": "Number of running requests",
    "num_waiting_reqs": "Number of waiting requests",
    "num_waiting_uncached_tokens": "Number of uncached input tokens waiting for prefill compute",
    "num_used_tokens": "Number of tokens in use",
    "num_total_tokens": "Used tokens plus pending prefill tokens",
    "max_total_num_tokens": "Maximum token capacity",
    "token_usage": "Token pool usage ratio",
    "gen_throughput": "Generation throughput (tokens/s)",
    "prefill_throughput": "Prefill throughput (tokens/s)",
    "cache_hit_rate": "Prefix cache hit rate",
    "utilization": "Utilization (always 0)",
    "max_running_requests": "Maximum running requests",
}


def parse_include(include: str | None) -> set[str]:
    """``include`` query value (comma-separated) -> section names.

    Raises:
        ValueError: an unknown section (the message lists the valid ones, as SGLang's).
    """
    if not include:
        return {"all"}
    sections = {s.strip() for s in include.split(",") if s.strip()}
    bad = sections - VALID_SECTIONS
    if bad:
        raise ValueError(f"Invalid include sections: {sorted(bad)}. Valid options: {sorted(VALID_SECTIONS)}")
    return sections


def rank_load(s: SchedulerStats) -> dict[str, Any]:
    """One DP rank's ``/v1/loads`` entry (see the module docstring)."""
    used = int(s.kv_used_tokens)
    pool = int(s.kv_pool_size)
    total_tokens = used + int(s.num_pending_tokens)
    hit = s.cached_prompt_tokens_total / s.prompt_tokens_total if s.prompt_tokens_total else 0.0
    return {
        "dp_rank": int(s.dp_rank),
        "timestamp": float(s.timestamp),
        "num_running_reqs": int(s.num_running_reqs),
        "num_waiting_reqs": int(s.num_waiting_reqs),
        "num_total_reqs": int(s.num_running_reqs) + int(s.num_waiting_reqs),
        "num_waiting_uncached_tokens": int(s.num_waiting_uncached_tokens),
        "num_used_tokens": used,
        "num_total_tokens": total_tokens,
        "max_total_num_tokens": pool,
        "max_running_requests": int(s.max_running_requests),
        "token_usage": round(used / pool, 4) if pool else 0.0,
        "gen_throughput": round(float(s.gen_throughput), 2),
        "prefill_throughput": round(float(s.prefill_throughput), 2),
        "cache_hit_rate": round(hit, 4),
        "utilization": 0.0,
    }


def aggregate(loads: list[dict[str, Any]]) -> dict[str, Any]:
    """Totals and averages over the ranks' entries (SGLang's older ``aggregate`` plus token totals)."""
    n = len(loads)

    def total(key: str) -> int:
        return sum(d[key] for d in loads)

    def avg(key: str, digits: int) -> float:
        return round(sum(d[key] for d in loads) / n, digits) if n else 0.0

    return {
        "total_running_reqs": total("num_running_reqs"),
        "total_waiting_reqs": total("num_waiting_reqs"),
        "total_reqs": total("num_running_reqs") + total("num_waiting_reqs"),
        "avg_token_usage": avg("token_usage", 4),
        "avg_throughput": avg("gen_throughput", 2),
        "avg_utilization": avg("utilization", 4),
        "total_waiting_uncached_tokens": total("num_waiting_uncached_tokens"),
        "total_used_tokens": total("num_used_tokens"),
        "total_tokens": total("num_total_tokens"),
    }


class LoadsQueryError(ValueError):
    """A bad ``/v1/loads`` query parameter; ``param`` names it (for the 400 body)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def parse_loads_query(query: Mapping[str, str]) -> tuple[str, int | None]:
    """``/v1/loads`` query parameters (SGLang's) -> ``(format, dp_rank)``.

    ``include``: comma-separated sections (checked, see :func:`parse_include`);
    ``format``: ``"json"`` (default) or ``"prometheus"``; ``dp_rank``: an int or absent
    (range-checked later by :func:`select_ranks`).

    Raises:
        LoadsQueryError: an unknown section or format, or a ``dp_rank`` that is not an integer.
    """
    try:
        parse_include(query.get("include"))
    except ValueError as e:
        raise LoadsQueryError(str(e), "include") from None
    fmt = query.get("format") or "json"
    if fmt not in ("json", "prometheus"):
        raise LoadsQueryError(f"format must be 'json' or 'prometheus', got {fmt!r}", "format")
    raw = query.get("dp_rank")
    if raw is None:
        return fmt, None
    try:
        return fmt, int(raw)
    except ValueError:
        raise LoadsQueryError(f"dp_rank must be an integer, got {raw!r}", "dp_rank") from None


def select_ranks(stats: Iterable[SchedulerStats], dp_size: int, dp_rank: int | None) -> list[SchedulerStats]:
    """The stats of every rank, or of ``dp_rank`` alone.

    Raises:
        ValueError: ``dp_rank`` outside ``[0, dp_size)``.
    """
    stats = sorted(stats, key=lambda s: s.dp_rank)
    if dp_rank is None:
        return stats
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} out of range [0, {dp_size})")
    return [s for s in stats if s.dp_rank == dp_rank]


def loads_body(stats: list[SchedulerStats], num_accelerators: int) -> dict[str, Any]:
    """The JSON body of ``GET /v1/loads`` for ``stats`` (one per reported rank)."""
    loads = [rank_load(s) for s in stats]
    return {
        "timestamp": datetime.now(timezone.utc).isoformat(),
        "version": PACKAGE_VERSION,
        "dp_rank_count": len(loads),
        "accelerator": None,
        "num_accelerators": num_accelerators,
        "loads": loads,
        "aggregate": aggregate(loads),
    }


class _LoadsCollector:
    def __init__(self, loads: list[dict[str, Any]]):
        self.loads = loads

    def collect(self):
        for field, doc in PROMETHEUS_FIELDS.items():
            g = GaugeMetricFamily(f"sglang_{field}", doc, labels=["dp_rank"])
            for d in self.loads:
                g.add_metric([str(d["dp_rank"])], float(d[field]))
            yield g


def loads_prometheus(stats: list[SchedulerStats]) -> bytes:
    """``GET /v1/loads?format=prometheus``: SGLang's ``sglang_<field>{dp_rank="d"}`` gauges, text format."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_LoadsCollector([rank_load(s) for s in stats]))
    return generate_latest(registry)


def legacy_load(stats: list[SchedulerStats], ts_tic: float) -> list[dict[str, Any]]:
    """The body of ``GET /get_load``: SGLang's older per-rank list (see the module docstring)."""
    out = []
    for s in sorted(stats, key=lambda s: s.dp_rank):
        d = rank_load(s)
        out.append({
            "dp_rank": d["dp_rank"],
            "num_reqs": d["num_total_reqs"],
            "num_waiting_reqs": d["num_waiting_reqs"],
            "num_tokens": d["num_total_tokens"],
            "num_pending_tokens": d["num_total_tokens"] - d["num_used_tokens"],
            "ts_tic": ts_tic,
        })
    return out
