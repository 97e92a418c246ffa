"""Turn per-request measurements into the bench report: numbers, JSON, PNG, table.

Definitions (all durations in seconds in the JSON, shown in ms in the table):

* request throughput = completed requests / duration; input (output) token
  throughput = summed prompt (completion) tokens of completed requests / duration;
  duration = first send -> last response;
* TTFT, ITL (gaps between streamed chunks), TPOT ((latency - TTFT) /
  (completion tokens - 1)) and end-to-end latency: mean, p50, p99 (numpy's
  linear-interpolated percentiles) over completed requests (ITL: over all gaps);
* cache hit rate = summed ``cached_tokens`` / summed ``prompt_tokens``, overall
  and per worker (workers from the responses, else from ``/metrics`` deltas).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np

from fleetserve.bench.client import RequestResult


def _stats(values: list[float]) -> dict[str, float | None]:
    """mean / p50 / p99 of ``values``; all None when nothing was measured (e.g. ITL and TPOT
    of non-streamed requests, which have no token timings), printed as "n/a"."""
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    a = np.asarray(values, dtype=np.float64)
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99))}


def summarize(results: list[RequestResult], duration_s: float,
              worker_deltas: dict[str, dict[str, float]] | None = None, meta: dict | None = None) -> dict:
    """The report as a dict (see the module docstring for definitions)."""
    ok = [r for r in results if r.success]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    out_tok = sum(r.completion_tokens for r in ok)
    dur = max(duration_s, 1e-9)
    # TPOT needs the time of the first token, which only a stream gives (a request whose stream
    # had a single chunk still has none of its own gaps, so its TPOT is left out like its ITL).
    tpot = [(r.latency - r.ttft) / (r.completion_tokens - 1) for r in ok if r.completion_tokens > 1 and r.itl]
    per_worker: dict[str, dict] = {}
    source = "none"
    if ok and all(r.worker for r in ok):
        source = "responses"
        acc: dict[str, dict] = defaultdict(lambda: {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0})
        for r in ok:
            w = acc[r.worker]
            w["requests"] += 1
            w["prompt_tokens"] += r.prompt_tokens
            w["cached_tokens"] += r.cached_tokens
        per_worker = dict(acc)
    elif worker_deltas:
        source = "metrics"
        per_worker = {u: {"requests": int(d["num_requests"]), "prompt_tokens": int(d["prompt_tokens"]),
                          "cached_tokens": int(d["cached_tokens"])} for u, d in worker_deltas.items()}
    for w in per_worker.values():
        w["hit_rate"] = w["cached_tokens"] / w["prompt_tokens"] if w["prompt_tokens"] else 0.0
    return {
        "meta": meta or {},
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.success})[:5],
        "duration_s": duration_s,
        "request_throughput": len(ok) / dur,
        "input_throughput": prompt / dur,
        "output_throughput": out_tok / dur,
        "total_prompt_tokens": prompt,
        "total_cached_tokens": cached,
        "total_completion_tokens": out_tok,
        "cache_hit_rate": cached / prompt if prompt else 0.0,
        "ttft_s": _stats([r.ttft for r in ok]),
        "itl_s": _stats([g for r in ok for g in r.itl]),
        "tpot_s": _stats(tpot),
        "e2e_latency_s": _stats([r.latency for r in ok]),
        "per_worker_source": source,
        "per_worker": dict(sorted(per_worker.items())),
    }


def write_json(summary: dict, results: list[RequestResult], path: str | Path) -> None:
    """Write ``{"summary": ..., "requests": [...]}`` to ``path``."""
    Path(path).write_text(json.dumps({"summary": summary, "requests": [r.to_dict() for r in results]}, indent=1))


def plot_png(summary: dict, results: list[RequestResult], path: str | Path) -> None:
    """Four panels: TTFT CDF, ITL CDF, latency over time, per-worker hit rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.success]
    fig, ax = plt.subplots(2, 2, figsize=(11, 8))
    for a, vals, title in ((ax[0, 0], [r.ttft for r in ok], "TTFT"),
                           (ax[0, 1], [g for r in ok for g in r.itl], "inter-token latency (per chunk)")):
        if vals:
            v = np.sort(np.asarray(vals)) * 1e3
            a.plot(v, np.arange(1, len(v) + 1) / len(v))
        a.set_xlabel("ms")
        a.set_ylabel("fraction of requests" if title == "TTFT" else "fraction of gaps")
        a.set_title(f"{title} CDF")
        a.grid(alpha=0.3)
    ax[1, 0].scatter([r.start for r in ok], [r.latency for r in ok], s=4)
    ax[1, 0].set_xlabel("send time (s)")
    ax[1, 0].set_ylabel("end-to-end latency (s)")
    ax[1, 0].set_title("latency over the run")
    ax[1, 0].grid(alpha=0.3)
    pw = summary.get("per_worker") or {}
    names = list(pw)
    ax[1, 1].bar(range(len(names)), [pw[n]["hit_rate"] for n in names])
    ax[1, 1].set_xticks(range(len(names)), [n.rsplit(":", 1)[-1] for n in names], rotation=60, fontsize=7)
    ax[1, 1].set_ylim(0, 1)
    ax[1, 1].axhline(summary["cache_hit_rate"], color="k", ls="--", lw=1, label="overall")
    ax[1, 1].set_title("cache hit rate per worker")
    ax[1, 1].legend()
    m = summary.get("meta") or {}
    fig.suptitle(f"{m.get('workload', '')} -> {m.get('url', '')}: {summary['request_throughput']:.2f} req/s, "
                 f"hit rate {summary['cache_hit_rate']:.1%}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def format_ms(s: dict[str, float | None]) -> str:
    """``"mean / p50 / p99"`` in milliseconds, or ``"n/a"`` when not measured."""
    if s["mean"] is None:
        return "n/a"
    return f"{s['mean'] * 1e3:.1f} / {s['p50'] * 1e3:.1f} / {s['p99'] * 1e3:.1f}"


def print_table(summary: dict) -> None:
    """A rich table of the headline numbers and the per-worker breakdown."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title="fleetserve bench", show_header=True)
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_row("completed / failed", f"{summary['completed']} / {summary['failed']}")
    t.add_row("duration (s)", f"{summary['duration_s']:.2f}")
    t.add_row("requests/s", f"{summary['request_throughput']:.3f}")
    t.add_row("input tokens/s", f"{summary['input_throughput']:.1f}")
    t.add_row("output tokens/s", f"{summary['output_throughput']:.1f}")
    t.add_row("cache hit rate", f"{summary['cache_hit_rate']:.1%}")
    for key, label in (("ttft_s", "TTFT"), ("itl_s", "ITL"), ("tpot_s", "TPOT"), ("e2e_latency_s", "E2E latency")):
        s = summary[key]
        t.add_row(f"{label} mean / p50 / p99 (ms)", format_ms(s))
    console = Console()
    console.print(t)
    if summary["per_worker"]:
        w = Table(title=f"per worker (from {summary['per_worker_source']})")
        for c in ("worker", "requests", "prompt tokens", "cached tokens", "hit rate"):
            w.add_column(c, justify="right" if c != "worker" else "left")
        for name, d in summary["per_worker"].items():
            w.add_row(name, str(d["requests"]), str(d["prompt_tokens"]), str(d["cached_tokens"]),
                      f"{d['hit_rate']:.1%}")
        console.print(w)
    if summary["errors"]:
        console.print(f"[red]errors:[/red] {summary['errors']}")
