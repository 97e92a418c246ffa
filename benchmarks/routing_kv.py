"""What ``--policy kv_aware`` buys over ``cache_aware``: the ``kv`` part of routing_experiment.py.

Simulated workers (``fleetserve sim-worker``) that publish KV-cache events as
the engine does (``--kv-events-config``, ``--page-size 16``) and tokenize with
SmolLM2's real tokenizer (``--tokenizer smollm2``); the router's kv_aware gets
the same tokenizer (``--tokenizer-path``, the folder ``fleetserve.models``
extracts from the bundled GGUF), so its token ids are the workers' ones.

Scenarios (one table each; the same seeded requests for every router of a table):

``pressure``  shared_prefix and multi_turn with a small KV pool per worker, so that
              the radix caches evict and a router's picture of them goes stale;
``replicas``  two router processes of the same policy in front of the same
              workers, each request sent to one of them at random (seeded);
``foreign``   a share of the requests (``--foreign-share``, 0.3) sent straight to
              a random worker, bypassing the router;
``dp``        workers with 2 DP-attention ranks each (``sim-worker --dp-size 2``,
              separate caches per rank); kv_aware with and without ``--dp-aware``.

Every run: flush the workers, start fresh router process(es), wait until each
kv_aware stream is ``exact`` (a second flush publishes ``AllBlocksCleared`` in
order), send the requests, read the routers' ``/metrics`` (prediction error,
stream states), stop the routers.

The bound column: the hit rate one infinite radix cache (page size 16) would
have had on the same request stream, in the order the requests were sent:
request ``i`` hits the longest run of whole pages of ``prompt_i[:-1]`` that some
earlier prompt starts with. No routing can beat it; concurrency can keep a real
fleet below it (a prompt that arrives while the first of its group is still in
prefill finds nothing).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import shlex
import time
import urllib.request
from pathlib import Path

import numpy as np

from doc_section import write_section
from fleetserve.bench import cli as bench_cli
from fleetserve.bench import report
from fleetserve.bench.client import run_requests
from fleetserve.models.tokenizer import tokenizer_dir

PAGE = 16
HTTP0, EV0 = 21000, 22000  # below the ephemeral range (32768..): no clash with client sockets
_next_router_port = [23000]  # every run its own ports: a killed router's port may sit in TIME_WAIT
SAME = ["--cache-threshold", "0.3", "--balance-abs-threshold", "64", "--balance-rel-threshold", "1.5"]


# ------------------------------------------------------------------ the bound
def page_keys(ids: list[int]) -> list[int]:
    """Chained hashes of the whole pages of ``ids``: key i names pages 0..i."""
    out, h = [], 0
    for i in range(len(ids) // PAGE):
        h = hash((h, tuple(ids[i * PAGE:(i + 1) * PAGE])))
        out.append(h)
    return out


def infinite_cache_bound(prompts: list[list[int]]) -> tuple[int, int]:
    """``(cached, prompt tokens)`` one infinite page-``PAGE`` radix cache gets on ``prompts`` in order."""
    seen: set[int] = set()
    cached = total = 0
    for ids in prompts:
        total += len(ids)
        keys = page_keys(ids[:-1])
        n = 0
        for k in keys:
            if k not in seen:
                break
            n += 1
        cached += n * PAGE
        seen.update(page_keys(ids))
    return cached, total


# ------------------------------------------------------------------ metrics
def scrape(url: str) -> str:
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            return r.read().decode()
    except OSError:
        return ""


def prediction_figures(texts: list[str]) -> dict:
    """Summed over routers and workers: answers judged, mean |predicted - reported|, predicted, reported."""
    from prometheus_client.parser import text_string_to_metric_families

    acc = {"count": 0.0, "abs_sum": 0.0, "exact": 0.0, "predicted": 0.0, "reported": 0.0}
    for text in texts:
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == "fleetserve_router_cache_prediction_abs_error_tokens_count":
                    acc["count"] += s.value
                elif s.name == "fleetserve_router_cache_prediction_abs_error_tokens_sum":
                    acc["abs_sum"] += s.value
                elif (s.name == "fleetserve_router_cache_prediction_abs_error_tokens_bucket"
                      and float(s.labels.get("le", "nan")) == 0.0):
                    acc["exact"] += s.value
                elif s.name == "fleetserve_router_cache_predicted_tokens_total":
                    acc["predicted"] += s.value
                elif s.name == "fleetserve_router_cache_reported_tokens_total":
                    acc["reported"] += s.value
    return acc


def stream_states(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for m in re.finditer(r'fleetserve_router_kv_stream_state\{[^}]*state="(\w+)"[^}]*\} 1\.0', text):
        out[m.group(1)] = out.get(m.group(1), 0) + 1
    return out


# ------------------------------------------------------------------ scenarios
def routers(dp: bool, tok: str, have_peer: bool, baseline: bool,
            variants: tuple[str, ...] = ()) -> list[tuple[str, str, list[str]]]:
    """(label, kind, flags); kind ``base``: our router from ``--baseline-src`` (the code before a change)."""
    kv = ["--policy", "kv_aware", "--tokenizer-path", tok]
    out = [("round_robin", "ours", ["--policy", "round_robin"]),
           ("cache_aware (ours)", "ours", ["--policy", "cache_aware", *SAME])]
    if have_peer:
        out.append(("cache_aware (sglang-router)", "sglang", ["--policy", "cache_aware", *SAME]))
    if baseline:
        out.append(("kv_aware (before)", "base", kv))
    out.append(("kv_aware", "ours", kv))
    for v in variants:  # e.g. "--kv-load-weight 0.1"
        out.append((f"kv_aware {v}", "ours", [*kv, *shlex.split(v)]))
    if dp:
        if baseline:
            out.append(("kv_aware --dp-aware (before)", "base", [*kv, "--dp-aware"]))
        out.append(("kv_aware --dp-aware", "ours", [*kv, "--dp-aware"]))
    return out


def workload_argv(name: str, a: argparse.Namespace) -> list[str]:
    if name == "shared_prefix":
        return ["--workload", "shared_prefix", "--num-groups", str(a.groups), "--prompts-per-group",
                str(a.prompts_per_group), "--system-prompt-len", str(a.system_len), "--question-len",
                str(a.question_len), "--output-len", str(a.output_len)]
    return ["--workload", "multi_turn", "--num-conversations", str(a.conversations), "--num-turns", str(a.turns),
            "--question-len", str(a.question_len), "--output-len", str(a.output_len),
            "--multi-turn-replies", "synthetic"]


SCENARIOS = {  # name: (workload, replicas, foreign share?, dp size)
    "pressure-shared_prefix": ("shared_prefix", 1, False, 1),
    "pressure-multi_turn": ("multi_turn", 1, False, 1),
    "replicas": ("multi_turn", 2, False, 1),
    "foreign": ("multi_turn", 1, True, 1),
    "dp": ("shared_prefix", 1, False, 2),
}


def run_router(label: str, kind: str, flags: list[str], urls: list[str], nreplicas: int, foreign: float,
               reqs, bargs, a, rx, logdir: Path, tok) -> dict:
    from routing_experiment import flush, port_free, router_cmd, start, stop, wait_healthy

    flush(urls)
    base = _next_router_port[0]
    _next_router_port[0] = base + 8
    ports = [base + j for j in range(nreplicas)]
    for _ in range(60):
        if all(port_free(p) for p in ports):
            break
        time.sleep(1)
    else:
        raise RuntimeError(f"router ports {ports} are taken")
    env = None
    if kind == "base":
        import os

        env = dict(os.environ, PYTHONPATH=str(Path(a.baseline_src).resolve()))
    def own(p: int) -> list[str]:  # sglang-router replicas: each its own Prometheus port (default 29000)
        return [*flags, "--prometheus-port", str(p + 2000)] if kind == "sglang" else flags

    procs = [start(router_cmd("sglang" if kind == "sglang" else "ours", p, urls, own(p), a.peer_python),
                   logdir / f"router-{label}-{j}.log", env) for j, p in enumerate(ports)]
    rurls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        wait_healthy(rurls, procs, 120)
        states = {}
        if "kv_aware" in flags:
            time.sleep(2.0)  # sources subscribe within a second of start
            flush(urls)  # AllBlocksCleared in order: every stream goes exact
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                states = [stream_states(scrape(u)) for u in rurls]
                if all(s.get("exact", 0) == rx["streams"] for s in states):
                    break
                time.sleep(0.5)
            print(f"    streams before the run: {states}", flush=True)
        pick = random.Random(a.seed + 7)
        dest = []
        for _ in reqs:
            if pick.random() < foreign:
                dest.append(urls[pick.randrange(len(urls))])
            else:
                dest.append(rurls[pick.randrange(nreplicas)])
        t0 = time.monotonic()
        results, duration = asyncio.run(run_requests(
            rurls[0], reqs, api="chat", model=None, request_rate=bargs.request_rate, seed=bargs.seed,
            time_scale=bargs.time_scale, progress=False, url_for=lambda i, _r: dest[i]))
        wall = time.monotonic() - t0
        texts = [scrape(u) for u in rurls]
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"router {label} died during the run")
    finally:
        for p in procs:
            stop(p)
    s = report.summarize(results, duration, None, {"label": label})
    ok = [r for r in results if r.success]
    s["ttft_p90_s"] = float(np.percentile([r.ttft for r in ok], 90)) if ok else None
    s["label"], s["router"], s["router_flags"], s["wall_s"] = label, kind, flags, wall
    s["prediction"] = prediction_figures(texts) if kind != "sglang" else None
    s["streams_after"] = [stream_states(t) for t in texts]
    branches: dict[str, int] = {}
    for r in results:
        if r.route:
            b = dict(p.split("=", 1) for p in r.route.split("; ")).get("branch", "?")
            branches[b] = branches.get(b, 0) + 1
    s["branches"] = branches
    s["direct_requests"] = sum(1 for d in dest if d in urls)
    s["requests"] = [{"rid": r.rid, "start": round(r.start, 4), "worker": r.worker, "ttft": round(r.ttft, 4),
                      "prompt": r.prompt_tokens, "cached": r.cached_tokens, "route": r.route,
                      "direct": dest[i] in urls} for i, r in enumerate(results)]
    # the bound, on the stream as it was sent
    by_rid = {q.rid: q for q in reqs}
    order = sorted(ok, key=lambda r: r.start)
    prompts = [tok.request_ids("/v1/chat/completions", {"messages": by_rid[r.rid].messages}) for r in order]
    c, t = infinite_cache_bound(prompts)
    s["bound_hit_rate"] = c / t if t else 0.0
    s["bound_token_mismatch"] = sum(1 for r, p in zip(order, prompts) if len(p) != r.prompt_tokens)
    pred = s["prediction"]
    mae = f"{pred['abs_sum'] / pred['count']:.0f}" if pred and pred["count"] else "-"
    print(f"  {label:<30} hit {s['cache_hit_rate']:6.1%} (bound {s['bound_hit_rate']:.1%})  "
          f"{s['request_throughput']:7.2f} req/s  TTFT p50 {s['ttft_s']['p50'] * 1e3:7.1f} p90 "
          f"{s['ttft_p90_s'] * 1e3:7.1f} p99 {s['ttft_s']['p99'] * 1e3:7.1f} ms  MAE {mae}  "
          f"failed {s['failed']}  branches {branches}  (wall {wall:.0f} s)", flush=True)
    return s


def table(rows: list[dict]) -> str:
    ref = next((r for r in rows if r["label"] == "cache_aware (ours)"), rows[0])
    out = ["| router | hit rate | bound | TTFT p50 (ms) | TTFT p90 (ms) | TTFT p99 (ms) | p90 vs cache_aware (ours) "
           "| out tok/s | req/s | pred. MAE (tokens) | exact guesses | pred. bias | failed |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p = r.get("prediction")
        if p and p["count"]:
            mae, ex = f"{p['abs_sum'] / p['count']:.0f}", f"{p['exact'] / p['count']:.0%}"
            bias = f"{(p['predicted'] - p['reported']) / p['reported']:+.0%}" if p["reported"] else "-"
        else:
            mae = ex = bias = "-"
        ratio = r["ttft_p90_s"] / ref["ttft_p90_s"] if ref["ttft_p90_s"] else float("nan")
        out.append(f"| {r['label']} | {r['cache_hit_rate']:.1%} | {r['bound_hit_rate']:.1%} | "
                   f"{r['ttft_s']['p50'] * 1e3:.0f} | {r['ttft_p90_s'] * 1e3:.0f} | {r['ttft_s']['p99'] * 1e3:.0f} | "
                   f"{ratio:.2f}x | {r['output_throughput']:.0f} | {r['request_throughput']:.2f} | {mae} | {ex} | "
                   f"{bias} | {r['failed']} |")
    return "\n".join(out)


def kv_part(a: argparse.Namespace) -> None:
    from routing_experiment import RESULTS, start, stop, wait_healthy

    from fleetserve.router.kv_events.tokenize import RouterTokenizer

    global HTTP0, EV0
    HTTP0, EV0 = HTTP0 + a.port_offset, EV0 + a.port_offset
    _next_router_port[0] += a.port_offset
    logdir = Path(a.log_dir)
    logdir.mkdir(parents=True, exist_ok=True)
    tdir = tokenizer_dir()
    tok = RouterTokenizer(tdir)
    have_peer = Path(a.peer_python).exists() and not a.no_peer
    out_file = RESULTS / f"{a.section}.json"
    all_rows = json.loads(out_file.read_text()) if out_file.exists() and a.keep else {}
    for name in a.scenarios:
        wname, nrep, foreign, dp = SCENARIOS[name]
        n = a.workers
        urls = [f"http://127.0.0.1:{HTTP0 + i}" for i in range(n)]
        cfg = {"publisher": "zmq", "endpoint": f"tcp://*:{EV0}", "replay_endpoint": f"tcp://*:{EV0 + 200}",
               "topic": "kv"}
        scale = a.time_scale
        sim = ["--port", str(HTTP0), "--num-workers", str(n), "--time-scale", str(scale), "--stream-interval",
               str(a.stream_interval), "--max-total-tokens", str(a.max_total_tokens), "--page-size", str(PAGE),
               "--tokenizer", "smollm2", "--kv-events-config", json.dumps(cfg)]
        if dp > 1:
            sim += ["--dp-size", str(dp)]
        wp = start([bench_cli.sys.executable, "-m", "fleetserve.cli", "sim-worker", *sim], logdir / f"sim-{name}.log")
        try:
            wait_healthy(urls, [wp], 180)
            rate = a.rate_per_worker * n if wname == "shared_prefix" else a.rate_per_worker_multi_turn * n
            bargs = bench_cli.build_parser().parse_args(
                [*workload_argv(wname, a), "--seed", str(a.seed), "--time-scale", str(scale),
                 "--request-rate", str(rate)])
            reqs = bench_cli.workload_from_args(bargs)
            share = a.foreign_share if foreign else 0.0
            print(f"== {name}: {n} workers x {dp} rank(s), {wname}, {len(reqs)} requests, {rate:g} req/s, "
                  f"{nrep} router(s), direct share {share:g}, KV {a.max_total_tokens} tokens per rank, "
                  f"k = {scale:g}", flush=True)
            rows = []
            all_rows[name] = {"workload": wname, "workers": n, "dp": dp, "replicas": nrep, "direct_share": share,
                              "rate": rate, "requests": len(reqs), "rows": rows}
            for label, kind, flags in routers(dp > 1, tdir, have_peer, bool(a.baseline_src), tuple(a.kv_variant)):
                if label in a.skip or (label == "round_robin" and not name.startswith("pressure")):
                    continue  # round robin: the pressure tables only (the reference; saves time)
                if kind == "base" and name == "dp":
                    continue  # the DP table compares --dp-aware on and off, both on this code
                rx = {"streams": n * dp}
                rows.append(run_router(label, kind, flags, urls, nrep, share, reqs, bargs, a, rx, logdir, tok))
                RESULTS.mkdir(exist_ok=True)
                out_file.write_text(json.dumps(all_rows, indent=1))
        finally:
            stop(wp)
        write_doc(a, all_rows, have_peer)


def cpu_model() -> str:
    """``lscpu``'s model name, or ``"unknown CPU"``."""
    import subprocess

    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "unknown CPU"
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def write_doc(a: argparse.Namespace, all_rows: dict, have_peer: bool) -> None:
    if a.no_doc:
        return
    body = [
        "Simulated workers (`fleetserve sim-worker`, timing profile `h100-llama8b`, "
        f"`--page-size {PAGE}`, `--tokenizer smollm2`, `--stream-interval {a.stream_interval}`) publishing "
        "KV-cache events over ZMQ; kv_aware reads them with `--tokenizer-path` set to the same SmolLM2 "
        "tokenizer. The KV pool is small on purpose "
        f"(`--max-total-tokens {a.max_total_tokens}` per worker or DP rank), so caches evict. The simulation "
        f"runs k = {a.time_scale:g} times slower than the model and the client divides its clock by k: times "
        "and rates are model time. Workloads: shared_prefix "
        f"{a.groups} groups x {a.prompts_per_group} prompts (system {a.system_len} + question {a.question_len} "
        f"tokens); multi_turn {a.conversations} conversations x {a.turns} turns ({a.question_len}-token "
        f"questions, synthetic {a.output_len}-token answers in the history); {a.output_len} output tokens; "
        "Poisson arrivals, seed 0, the same requests for every row of a table. cache_aware rows (ours and "
        "sglang-router's) use sgl-router's default thresholds (cache 0.3, balance abs 64 / rel 1.5); kv_aware "
        "its defaults (`--kv-prefill-weight 1`, `--kv-load-weight 0.1`, speculative TTL 2 s, `/v1/loads` every 1 s). "
        "**hit rate**: cached / prompt tokens as the workers report them, over all requests (direct ones too). "
        "**bound**: the hit rate one infinite radix cache (page 16) would have had on the same requests in "
        "the order they were sent (each prompt hits the longest run of whole pages of `prompt[:-1]` that an "
        "earlier prompt starts with); no router can beat it. **pred. MAE**: the router's "
        "`fleetserve_router_cache_prediction_abs_error_tokens` mean (predicted vs. the worker's reported "
        "cached tokens per answer; both replicas summed), **exact guesses** its `le=\"0\"` share, **bias** "
        "(predicted - reported) / reported; sglang-router has no such metric. "
        + ("" if have_peer else "sglang-router was not installed: its column is missing. ")
        + f"The machine ({cpu_model()}, 2 cores) was shared with other jobs while this ran (load average "
          "20-50), so absolute figures are noisy; compare rows within a table. "
        + ("Rows `(before)` run the router from `--baseline-src`, the code before a change. " if a.baseline_src
           else "") + "Round robin runs in the KV-pressure tables only. " + a.note, ""]
    titles = {"pressure-shared_prefix": "KV pressure, shared_prefix",
              "pressure-multi_turn": "KV pressure, multi_turn",
              "replicas": "two router replicas, traffic split at random",
              "foreign": f"{a.foreign_share:.0%} of the traffic straight to the workers",
              "dp": "DP attention, 2 ranks per worker (separate caches)"}
    for name, t in all_rows.items():
        body += [f"### {titles.get(name, name)} ({t['workers']} workers x {t['dp']} rank(s), {t['workload']}, "
                 f"{t['requests']} requests at {t['rate']:g} req/s)", "", table(t["rows"]), ""]
    cmd = "python benchmarks/routing_experiment.py kv " + " ".join(shlex.quote(x) for x in a.argv)
    write_section(a.section, a.title, cmd.strip(), "\n".join(body))


def add_parser(sub) -> None:
    k = sub.add_parser("kv", help="kv_aware vs cache_aware on sim-workers with KV events")
    k.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    k.add_argument("--workers", type=int, default=4)
    k.add_argument("--time-scale", type=float, default=4.0)
    k.add_argument("--stream-interval", type=int, default=16)
    k.add_argument("--max-total-tokens", type=int, default=16_000)
    k.add_argument("--rate-per-worker", type=float, default=8.0)
    k.add_argument("--rate-per-worker-multi-turn", type=float, default=4.0)
    k.add_argument("--groups", type=int, default=24)
    k.add_argument("--prompts-per-group", type=int, default=8)
    k.add_argument("--system-len", type=int, default=2048)
    k.add_argument("--conversations", type=int, default=32)
    k.add_argument("--turns", type=int, default=6)
    k.add_argument("--question-len", type=int, default=128)
    k.add_argument("--output-len", type=int, default=128)
    k.add_argument("--foreign-share", type=float, default=0.3)
    k.add_argument("--seed", type=int, default=0)
    k.add_argument("--skip", nargs="*", default=[], help="router labels to leave out")
    k.add_argument("--no-peer", action="store_true", help="leave sglang-router out")
    k.add_argument("--kv-variant", action="append", default=[],
                   help="extra kv_aware row with these router flags (repeatable), e.g. '--kv-load-weight 0.1'")
    k.add_argument("--baseline-src", default="",
                   help="a src/ folder of an earlier fleetserve: adds kv_aware rows of its router, '(before)'")
    k.add_argument("--keep", action="store_true", help="keep other scenarios' rows from the results file")
    k.add_argument("--port-offset", type=int, default=0,
                   help="added to every port (workers 21000.., events 22000.., routers 23000..): two runs at once")
    k.add_argument("--section", default="routing-kv")
    k.add_argument("--title", default="Routing: kv_aware vs cache_aware on simulated workers with KV events")
    k.add_argument("--note", default="")
