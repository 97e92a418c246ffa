"""What cache-aware routing buys: round robin vs our cache_aware vs sglang-router's cache_aware.

Two parts, each one run per table (same workers, same requests, each router in turn):

``sim``    simulated workers (``fleetserve sim-worker``, one process hosting N
           workers, engine radix cache + timing model ``h100-llama8b``), 8 and 16
           workers, full-size ``shared_prefix`` and ``multi_turn``; the three
           routers plus a sweep of ``--cache-threshold`` and the balance thresholds.
``engine`` real engines: ``fleetserve serve`` instances of SmolLM2 on this CPU,
           small ``shared_prefix`` and ``multi_turn``; the three routers, or those
           named by ``--routers`` (``kv_aware`` among them starts every instance
           publishing KV events, ``--kv-events-config`` on ports of its own, and gives
           the router the model's tokenizer).

Before every run each worker's radix cache is flushed (``POST /flush_cache``),
a fresh router process is started on the workers, the bench runs, and the
router is stopped. sglang-router comes from PyPI in its own virtual
environment (``--peer-python``, default ``/tmp/peers/bin/python``; create it
with ``python -m venv /tmp/peers && /tmp/peers/bin/pip install sglang-router``);
it is never installed in the project's venv.

Usage::

    python benchmarks/routing_experiment.py sim    [--workers 8 16] [--time-scale 8] [--no-doc]
                                                   [--max-concurrency-per-worker C] [--section NAME]
    python benchmarks/routing_experiment.py engine [--instances 2] [--no-doc]
                                                   [--max-concurrency C] [--section NAME]
    python benchmarks/routing_experiment.py kv     [--scenarios ...] [--workers 4] [--no-doc]

``kv`` (benchmarks/routing_kv.py): kv_aware against cache_aware on sim-workers that
publish KV events, under KV pressure, two router replicas, direct traffic, DP ranks.
``kv --rates search|R ...`` (benchmarks/routing_kv_rate.py): one scenario at open-loop
Poisson rates around each router's sustainable rate (found by a lockstep bisection),
with queue figures per rate.

``--sim-loads-api vllm`` (every part) starts the sim-workers with ``--loads-api vllm``: they
answer load queries as vLLM servers do (no ``/v1/loads``; vLLM's gauges on ``/metrics``), to
see the routers against vLLM-like workers; default ``sglang``.

Arrivals are Poisson (``--rate-per-worker`` / ``--rate``) unless a closed
loop is asked for (``--max-concurrency...``: that many requests in flight,
as SGLang's bench_serving ``--max-concurrency``).

Tables go to docs/benchmarks.md (sections ``routing-sim`` and
``routing-engine``) through benchmarks/doc_section.py; raw summaries to
benchmarks/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from doc_section import write_section  # noqa: E402

from fleetserve.bench import cli as bench_cli  # noqa: E402

PY = sys.executable
RESULTS = HERE / "results"


# ------------------------------------------------------------------ processes
def _get(url: str, timeout: float = 2.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return 0


def start(cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    f = open(log, "ab")
    try:
        return subprocess.Popen(cmd, start_new_session=True, stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env)
    finally:
        f.close()


def stop(p: subprocess.Popen, grace: float = 15.0) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    try:
        p.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait(timeout=10)


def wait_healthy(urls: list[str], procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending = list(urls)
    while pending:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a process exited during start-up")
        pending = [u for u in pending if _get(u + "/health") != 200]
        if time.monotonic() > deadline:
            raise RuntimeError(f"not healthy within {timeout} s: {pending}")
        if pending:
            time.sleep(0.5)


ROUTER_LOG_LEVEL = os.environ.get("ROUTING_EXPERIMENT_ROUTER_LOG_LEVEL", "warn")  # debug: kv_aware's cost terms


def router_cmd(kind: str, port: int, urls: list[str], flags: list[str], peer_python: str) -> list[str]:
    if kind == "ours":
        return [PY, "-m", "fleetserve.cli", "router", "--host", "127.0.0.1", "--port", str(port),
                "--worker-urls", *urls, "--log-level", ROUTER_LOG_LEVEL, *flags]
    return [peer_python, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", *urls, "--log-level", "warn", *flags]


def flush(urls: list[str]) -> None:
    for u in urls:
        req = urllib.request.Request(u + "/flush_cache", data=b"", method="POST")
        for _ in range(20):
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)  # still finishing requests of the previous run


def warm(urls: list[str], model: str) -> None:
    """One short completion from each instance before the first row: an engine's first forward packs
    its weights (``layers/cpu_gemm.py``: ~1.1 s for SmolLM2 on this CPU), which would otherwise land in
    the first row's first requests only (its TTFT p99) and favour every later row."""
    body = json.dumps({"model": model, "prompt": "The capital of France is", "max_tokens": 2,
                       "temperature": 0}).encode()
    for u in urls:
        req = urllib.request.Request(u + "/v1/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            r.read()


# ----------------------------------------------------------------- one run
def port_free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def run_one(label: str, kind: str, flags: list[str], urls: list[str], bench_argv: list[str], port: int,
            peer_python: str, logdir: Path, baseline_src: str = "") -> dict:
    flush(urls)
    for _ in range(60):  # the previous router may still be closing
        if port_free(port):
            break
        time.sleep(1)
    else:
        raise RuntimeError(f"port {port} is taken by another process: refusing to measure the wrong router")
    env = None
    if kind == "base":  # our router from --baseline-src: the code before a change
        env = dict(os.environ, PYTHONPATH=str(Path(baseline_src).resolve()))
    rp = start(router_cmd("ours" if kind == "base" else kind, port, urls, flags, peer_python),
               logdir / f"router-{label}.log", env)
    try:
        wait_healthy([f"http://127.0.0.1:{port}"], [rp], 120)
        time.sleep(0.5)
        if rp.poll() is not None:
            raise RuntimeError(f"router {label} exited (code {rp.returncode}); see its log")
        args = bench_cli.build_parser().parse_args(
            ["--base-url", f"http://127.0.0.1:{port}", "--disable-tqdm", "--worker-urls", *urls, *bench_argv])
        t0 = time.monotonic()
        load0 = os.getloadavg()[0]
        summary, _ = asyncio.run(bench_cli.run_bench(args))
        summary["wall_s"] = time.monotonic() - t0
        summary["loadavg_1m"] = (load0, os.getloadavg()[0])  # the shared machine's, at the row's start and end
        if rp.poll() is not None:
            raise RuntimeError(f"router {label} died during the run")
        if "kv_aware" in flags:  # its decisions by trust (exact / degraded / fallback), before it stops
            import re

            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                text = r.read().decode()
            summary["kv_decisions"] = {b: int(float(n)) for b, n in re.findall(
                r'fleetserve_router_kv_decisions_total\{branch="(\w+)"\} (\S+)', text)}
            print(f"  kv_aware decisions: {summary['kv_decisions']}", flush=True)
    finally:
        stop(rp)
    summary["label"], summary["router"], summary["router_flags"] = label, kind, flags
    print(f"  {label:<34} hit {summary['cache_hit_rate']:6.1%}  {summary['request_throughput']:8.2f} req/s  "
          f"TTFT p50 {summary['ttft_s']['p50'] * 1e3:8.1f} ms  p99 {summary['ttft_s']['p99'] * 1e3:8.1f} ms  "
          f"failed {summary['failed']}  (wall {summary['wall_s']:.0f} s)", flush=True)
    return summary


def table(rows: list[dict]) -> str:
    base = next((r for r in rows if r["label"] == "round_robin"), rows[0])

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.2f}x" if b else "-"

    out = ["| router | hit rate | vs RR | req/s | vs RR | out tok/s | TTFT p50 (ms) | TTFT p99 (ms) | "
           "TTFT p50 vs RR | ITL p50 (ms) | failed |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(
            f"| {r['label']} | {r['cache_hit_rate']:.1%} | {ratio(r['cache_hit_rate'], base['cache_hit_rate'])} | "
            f"{r['request_throughput']:.2f} | {ratio(r['request_throughput'], base['request_throughput'])} | "
            f"{r['output_throughput']:.0f} | {r['ttft_s']['p50'] * 1e3:.0f} | {r['ttft_s']['p99'] * 1e3:.0f} | "
            f"{ratio(r['ttft_s']['p50'], base['ttft_s']['p50'])} | {r['itl_s']['p50'] * 1e3:.1f} | {r['failed']} |")
    return "\n".join(out)


def routers(sweep: bool, bounded: tuple[float, ...] = ()) -> list[tuple[str, str, list[str]]]:
    """(label, kind, flags). Both cache_aware routers get the same (sgl-router default) thresholds;
    ``bounded`` adds one row per ``--bounded-load-factor`` of ours."""
    same = ["--cache-threshold", "0.3", "--balance-abs-threshold", "64", "--balance-rel-threshold", "1.5"]
    out = [("round_robin", "ours", ["--policy", "round_robin"]),
           ("cache_aware (ours)", "ours", ["--policy", "cache_aware", *same]),
           ("cache_aware (sglang-router 0.3.2)", "sglang", ["--policy", "cache_aware", *same])]
    for c in bounded:
        out.append((f"ours, bounded load {c:g}", "ours",
                    ["--policy", "cache_aware", "--cache-threshold", "0.3", "--bounded-load-factor", str(c)]))
    if sweep:
        for ct in ("0.1",):
            out.append((f"ours, cache_threshold={ct}", "ours",
                        ["--policy", "cache_aware", "--cache-threshold", ct, "--balance-abs-threshold", "64",
                         "--balance-rel-threshold", "1.5"]))
        for ab, rel in (("8", "1.1"), ("100000", "1000")):
            out.append((f"ours, balance abs={ab} rel={rel}", "ours",
                        ["--policy", "cache_aware", "--cache-threshold", "0.3", "--balance-abs-threshold", ab,
                         "--balance-rel-threshold", rel]))
    return out


# ---------------------------------------------------------------------- sim
def sim_loads_args(a: argparse.Namespace) -> list[str]:
    """The sim-worker flags for ``--sim-loads-api`` (passed to every sim-worker the parts start)."""
    return ["--loads-api", getattr(a, "sim_loads_api", "sglang")]


def sim_loads_note(a: argparse.Namespace) -> str:
    """A sentence for the doc sections when the sim-workers answer loads as vLLM does, else ``""``."""
    if getattr(a, "sim_loads_api", "sglang") != "vllm":
        return ""
    return ("The sim-workers ran with `--loads-api vllm`: no `/v1/loads` or `/get_load` (404, as a vLLM "
            "server), vLLM's per-rank gauges on `/metrics`. ")


def write_sim_doc(a: argparse.Namespace, sections: list) -> None:
    body = [
        "Simulated workers: `fleetserve sim-worker`, profile `h100-llama8b` (Llama-3.1-8B bf16 on one H100, "
        "constants derived from the H100 datasheet, see `fleetserve/bench/timing_model.py`), "
        f"KV capacity {a.max_total_tokens} tokens per worker, `--stream-interval {a.stream_interval}`. "
        "The simulation runs k times slower than the model (k in each table's title) and the bench divides "
        "its clock by the same factor, so all times and rates below are in model time (the slow-down keeps "
        "the Python router, workers and client on this 2-core machine from being the bottleneck). "
        + (f"Closed loop: {a.max_concurrency_per_worker} requests in flight per worker (a client sends its next "
           "request when one ends; multi_turn turns still wait for the previous answer). "
           if a.max_concurrency_per_worker else
           f"Poisson arrivals at {a.rate_per_worker:g} (shared_prefix) and {a.rate_per_worker_multi_turn:g} "
           "(multi_turn, first turns; later turns wait for the previous answer) requests/s per worker. ")
        + "Workloads (full size): shared_prefix 64 groups x 16 "
        "prompts, system prompt 2048 + question 128 tokens, 256 output tokens (1024 requests); multi_turn 64 "
        "conversations x 8 turns, 128-token questions, 256-token answers (512 requests, each turn sent after "
        "the previous one finished). Both cache_aware routers run with sgl-router's default thresholds "
        "(cache 0.3, balance abs 64 / rel 1.5); the sweep rows vary one of them on our router. Every run "
        "starts from empty worker caches and a fresh router process. Ratios are to round robin on the same "
        "table (TTFT: lower is better). " + sim_loads_note(a) + a.note, ""]
    for n, wname, rate, scale, rows in sections:
        load = (f"{a.max_concurrency_per_worker * n} in flight" if a.max_concurrency_per_worker
                else f"{rate:g} req/s")
        body += [f"### {n} workers, {wname} ({load}, k = {scale:g})", "", table(rows), ""]
    body += ["Reference point: SGLang's v0.4 release reported 3.8x hit rate (75% vs 20%) and 1.9x throughput "
             "for cache-aware routing over round robin on generated-shared-prefix with 8 workers."]
    if not a.no_doc:
        cmd = "python benchmarks/routing_experiment.py sim " + " ".join(shlex.quote(x) for x in a.argv)
        write_section(a.section, a.title, cmd.strip(), "\n".join(body))



def sim_part(a: argparse.Namespace) -> None:
    logdir = Path(a.log_dir)
    logdir.mkdir(parents=True, exist_ok=True)
    workloads = {
        "shared_prefix": ["--workload", "shared_prefix", "--num-groups", "64", "--prompts-per-group", "16",
                          "--system-prompt-len", "2048", "--question-len", "128", "--output-len", "256"],
        "multi_turn": ["--workload", "multi_turn", "--num-conversations", "64", "--num-turns", "8",
                       "--question-len", "128", "--output-len", "256",
                       "--multi-turn-replies", "synthetic"],  # the recorded tables' mode: same requests per router
    }
    all_rows: dict = {}
    sections = []
    for n in a.workers:
        port0 = 36000
        urls = [f"http://127.0.0.1:{port0 + i}" for i in range(n)]
        for wname in a.workloads:
            scale = a.time_scale if wname == "shared_prefix" else a.time_scale_multi_turn
            sim_flags = ["--port", str(port0), "--num-workers", str(n), "--time-scale", str(scale),
                         "--stream-interval", str(a.stream_interval), "--max-total-tokens", str(a.max_total_tokens),
                         *sim_loads_args(a)]
            wp = start([PY, "-m", "fleetserve.cli", "sim-worker", *sim_flags], logdir / f"sim-{n}-{wname}.log")
            try:
                wait_healthy(urls, [wp], 120)
                rate = (a.rate_per_worker if wname == "shared_prefix" else a.rate_per_worker_multi_turn) * n
                arrivals = ["--request-rate", str(rate)]
                if a.max_concurrency_per_worker:
                    rate = math.inf
                    arrivals = ["--request-rate", "inf", "--max-concurrency", str(a.max_concurrency_per_worker * n)]
                bench_argv = [*workloads[wname], "--seed", "0", "--time-scale", str(scale), *arrivals]
                print(f"== sim: {n} workers, {wname}, {arrivals}, time scale {scale}", flush=True)
                sweep = a.sweep and n in a.sweep_workers and wname == "shared_prefix"
                rows: list[dict] = []
                all_rows[f"{n}-{wname}"] = rows
                sections.append((n, wname, rate, scale, rows))
                for label, kind, flags in routers(sweep, tuple(a.bounded_load)):
                    rows.append(run_one(label, kind, flags, urls, bench_argv, 36900, a.peer_python, logdir))
                    RESULTS.mkdir(exist_ok=True)
                    (RESULTS / f"{a.section}.json").write_text(json.dumps(all_rows, indent=1))
                write_sim_doc(a, sections)
            finally:
                stop(wp)


# ------------------------------------------------------------------- engine
def load_args(a: argparse.Namespace) -> list[str]:
    """The bench's arrival flags: closed loop at ``--max-concurrency`` if given, else Poisson ``--rate``."""
    if a.max_concurrency:
        return ["--max-concurrency", str(a.max_concurrency), "--request-rate", "inf"]
    return ["--request-rate", str(a.rate)]


def load_text(a: argparse.Namespace) -> str:
    if a.max_concurrency:
        return f"closed loop, {a.max_concurrency} requests in flight (each client sends its next as one ends)"
    return f"Poisson {a.rate} requests/s"


KV_EVENTS_PORT = 37500  # instance i publishes on + i, its replay endpoint on + 100 + i


def engine_routers(a: argparse.Namespace) -> list[tuple[str, str, list[str]]]:
    """The rows of ``--routers`` in their order: round_robin, cache_aware (ours), sglang (its cache_aware),
    kv_aware (ours, default weights, the model's tokenizer, the engines' KV events)."""
    rows = {label.split(" ")[0] if kind == "ours" else "sglang": (label, kind, flags)
            for label, kind, flags in routers(False, ())}
    kv_flags = []
    if "kv_aware" in a.routers:
        from fleetserve.models.tokenizer import tokenizer_dir

        kv_flags = ["--policy", "kv_aware", "--tokenizer-path", tokenizer_dir()]
        rows["kv_aware"] = ("kv_aware (ours)", "ours", kv_flags)
    out = [rows[name] for name in a.routers]
    if a.baseline_src and kv_flags:  # the same kv_aware flags on the code before a change, after ours
        i = next(i for i, r in enumerate(out) if r[0] == "kv_aware (ours)")
        out.insert(i + 1, ("kv_aware (before)", "base", kv_flags))
    for extra in a.kv_variant:  # more kv_aware rows, each with these flags added (e.g. an old weight)
        out.append((f"kv_aware {extra}", "ours", [*kv_flags, *shlex.split(extra)]))
    for c in a.bounded_load:
        out.append((f"ours, bounded load {c:g}", "ours",
                    ["--policy", "cache_aware", "--cache-threshold", "0.3", "--bounded-load-factor", str(c)]))
    return out


def engine_part(a: argparse.Namespace) -> None:
    logdir = Path(a.log_dir)
    logdir.mkdir(parents=True, exist_ok=True)
    port0 = 36500 + a.port_offset
    urls = [f"http://127.0.0.1:{port0 + i}" for i in range(a.instances)]
    threads = a.threads_per_instance or max(1, (os.cpu_count() or 1) // a.instances)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))  # instances share the cores: no oversubscription

    def events(i: int) -> list[str]:
        if "kv_aware" not in a.routers:
            return []
        port = KV_EVENTS_PORT + a.port_offset + i
        cfg = {"publisher": "zmq", "endpoint": f"tcp://*:{port}", "replay_endpoint": f"tcp://*:{port + 100}"}
        return ["--kv-events-config", json.dumps(cfg)]

    if a.sim_worker is not None:  # a cheap stand-in: one sim-worker per instance (same ports, events, pool)
        serve = ["sim-worker", "--tokenizer", "smollm2", "--model-name", a.model, "--num-workers", "1",
                 *sim_loads_args(a), *shlex.split(a.sim_worker)]
    else:
        serve = ["serve"]
    procs = [start([PY, "-m", "fleetserve.cli", *serve, "--host", "127.0.0.1", "--port", str(port0 + i),
                    *shlex.split(a.engine_args), *events(i)], logdir / f"engine-{i}.log", env)
             for i in range(a.instances)]
    workloads = {
        "shared_prefix": ["--workload", "shared_prefix", "--num-groups", str(a.groups), "--prompts-per-group",
                          str(a.prompts_per_group), "--system-prompt-len", str(a.system_len), "--question-len",
                          str(a.question_len), "--output-len", str(a.output_len)],
        "multi_turn": ["--workload", "multi_turn", "--num-conversations", str(a.conversations), "--num-turns",
                       str(a.turns), "--question-len", str(a.question_len), "--output-len", str(a.output_len),
                       "--multi-turn-replies", "synthetic"],  # the recorded tables' mode: same requests per router
    }
    sections = []
    all_rows = {}
    loads = [os.getloadavg()[0]]
    try:
        wait_healthy(urls, procs, 900)
        time.sleep(2)
        if any(p.poll() is not None for p in procs):  # e.g. a port taken: another process answered /health
            raise RuntimeError("an instance exited after start-up; see its log")
        warm(urls, a.model)  # each row flushes the caches (run_one) before it starts
        for wname in a.workloads:
            # sglang-router fills in model "unknown" when a request names none, which our engine rejects
            bench_argv = [*workloads[wname], "--seed", "0", *load_args(a), "--model", a.model]
            print(f"== engine: {a.instances} instances, {wname}, {load_text(a)}", flush=True)
            # each row its own router port: a stopped router's port may sit in TIME_WAIT for a minute
            rows = [run_one(label, kind, flags, urls, bench_argv, 36900 + a.port_offset + j, a.peer_python, logdir,
                            a.baseline_src)
                    for j, (label, kind, flags) in enumerate(engine_routers(a))]
            all_rows[wname] = rows
            sections.append((wname, rows))
            RESULTS.mkdir(exist_ok=True)
            (RESULTS / "routing_engine.json").write_text(json.dumps(all_rows, indent=1))
    finally:
        loads.append(os.getloadavg()[0])
        for p in procs:
            stop(p, grace=20)
    body = [f"Real engines: {a.instances} `fleetserve serve` instances of SmolLM2-135M-Instruct on this CPU "
            f"(`{a.engine_args}`), all on the same 2 cores. Workloads scaled down to finish in minutes: "
            f"shared_prefix {a.groups} groups x {a.prompts_per_group} prompts, system prompt {a.system_len} + "
            f"question {a.question_len} tokens; multi_turn {a.conversations} conversations x {a.turns} turns, "
            f"{a.question_len}-token questions; {a.output_len} output tokens; {load_text(a)}; "
            f"{threads} torch thread{'' if threads == 1 else 's'} per instance. "
            "Caches flushed and a fresh router before every run; ratios to round robin. "
            + (sim_loads_note(a) if a.sim_worker is not None else "") + a.note, "",
            f"1-minute load average: {loads[0]:.1f} at the start, {loads[1]:.1f} at the end (the machine is shared).",
            ""]
    for wname, rows in sections:
        body += [f"### {wname}", "", table(rows), ""]
        per = []
        for r in rows:  # requests per instance, in the order of --worker-urls
            pw = r.get("per_worker") or {}
            per.append(f"{r['label']} " + " / ".join(str(pw.get(u, {}).get("requests", 0)) for u in urls))
        body += ["Requests per instance: " + "; ".join(per) + ".", "",
                 "1-minute load average at each row's start and end: " + "; ".join(
                     f"{r['label']} {r['loadavg_1m'][0]:.1f} / {r['loadavg_1m'][1]:.1f}" for r in rows) + ".", ""]
        for r in rows:
            if r.get("kv_decisions"):
                body += [f"{r['label']} decisions by trust: "
                         + ", ".join(f"{k} {v}" for k, v in sorted(r["kv_decisions"].items())) + ".", ""]
    if not a.no_doc:
        cmd = "python benchmarks/routing_experiment.py engine " + " ".join(shlex.quote(x) for x in a.argv)
        write_section(a.section, a.title, cmd.strip(), "\n".join(body))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="part", required=True)
    s = sub.add_parser("sim")
    s.add_argument("--workers", type=int, nargs="+", default=[8, 16])
    s.add_argument("--workloads", nargs="+", default=["shared_prefix", "multi_turn"],
                   choices=["shared_prefix", "multi_turn"])
    s.add_argument("--time-scale", type=float, default=8.0)
    s.add_argument("--stream-interval", type=int, default=16)
    s.add_argument("--max-total-tokens", type=int, default=430_000)
    s.add_argument("--rate-per-worker", type=float, default=16.0, help="shared_prefix arrivals per worker")
    s.add_argument("--rate-per-worker-multi-turn", type=float, default=8.0)
    s.add_argument("--time-scale-multi-turn", type=float, default=3.0)
    s.add_argument("--max-concurrency-per-worker", type=int, default=0,
                   help="closed loop with this many requests in flight per worker instead of Poisson arrivals")
    s.add_argument("--sweep", action="store_true", help="add the threshold sweep rows")
    s.add_argument("--sweep-workers", type=int, nargs="+", default=[8])
    s.add_argument("--section", default="routing-sim", help="docs/benchmarks.md section name")
    s.add_argument("--title", default="Routing: cache-aware vs round robin on simulated workers")
    s.add_argument("--note", default="", help="a sentence added to the section's description")
    e = sub.add_parser("engine")
    e.add_argument("--instances", type=int, default=2)
    e.add_argument("--engine-args", default="--max-total-tokens 8192")
    e.add_argument("--workloads", nargs="+", default=["shared_prefix", "multi_turn"],
                   choices=["shared_prefix", "multi_turn"])
    e.add_argument("--groups", type=int, default=4)
    e.add_argument("--prompts-per-group", type=int, default=4)
    e.add_argument("--system-len", type=int, default=512)
    e.add_argument("--conversations", type=int, default=4)
    e.add_argument("--turns", type=int, default=4)
    e.add_argument("--question-len", type=int, default=32)
    e.add_argument("--output-len", type=int, default=16)
    e.add_argument("--rate", type=float, default=1.0)
    e.add_argument("--max-concurrency", type=int, default=0,
                   help="closed loop with this many requests in flight instead of Poisson --rate")
    e.add_argument("--threads-per-instance", type=int, default=0,
                   help="OMP_NUM_THREADS of each instance (default: cores / instances)")
    e.add_argument("--section", default="routing-engine", help="docs/benchmarks.md section name")
    e.add_argument("--title", default="Routing: cache-aware vs round robin on real engines (CPU)")
    e.add_argument("--note", default="", help="a sentence added to the section's description")
    e.add_argument("--model", default="SmolLM2-135M-Instruct.Q4_1", help="model name the instances serve")
    e.add_argument("--routers", nargs="+", default=["round_robin", "cache_aware", "sglang"],
                   choices=["round_robin", "cache_aware", "sglang", "kv_aware"],
                   help="rows, in this order (kv_aware: the instances publish KV events)")
    e.add_argument("--baseline-src", default="", metavar="DIR",
                   help="add a `kv_aware (before)` row: the router run from this src folder (the code before a change)")
    e.add_argument("--port-offset", type=int, default=0,
                   help="added to every port (instances 36500+i, router 36900, KV events 37500+i): two runs at once")
    e.add_argument("--sim-worker", default=None, metavar="FLAGS",
                   help="run `fleetserve sim-worker --tokenizer smollm2 FLAGS` instances instead of `fleetserve serve` "
                        "(e.g. '--profile cpu-smollm2 --page-size 1'; --engine-args still apply): a quick stand-in")
    e.add_argument("--kv-variant", action="append", default=[], metavar="FLAGS",
                   help="one more kv_aware row with these router flags added (repeatable), e.g. '--kv-queue-weight 0'")
    import routing_kv

    routing_kv.add_parser(sub)
    k = sub.choices["kv"]
    for q in (s, e, k):
        q.add_argument("--peer-python", default="/tmp/peers/bin/python")
        q.add_argument("--log-dir", default="/tmp/routing_experiment")
        q.add_argument("--no-doc", action="store_true")
        q.add_argument("--bounded-load", type=float, nargs="*", default=[],
                       help="also run our cache_aware with each of these --bounded-load-factor values")
        q.add_argument("--sim-loads-api", choices=("sglang", "vllm"), default="sglang",
                       help="every sim-worker started gets --loads-api this: vllm: the workers answer loads as "
                            "vLLM servers do (/v1/loads and /get_load 404, vLLM's gauges on /metrics)")
    a = p.parse_args()
    counts = ("workers", "instances", "stream_interval", "max_total_tokens", "max_concurrency", "max_concurrency_per_worker", "threads_per_instance",
              "groups", "prompts_per_group", "system_len", "conversations", "turns", "question_len", "output_len")
    for name in counts:
        v = getattr(a, name, None)
        if v is None:
            continue
        low = 0 if name.startswith(("max_concurrency", "threads")) else 1  # 0: off / automatic
        if any(x < low for x in (v if isinstance(v, list) else [v])):
            p.error(f"--{name.replace('_', '-')} must be >= {low}, got {v}")
    for name in ("rate", "rate_per_worker", "rate_per_worker_multi_turn", "time_scale", "time_scale_multi_turn"):
        v = getattr(a, name, None)
        if v is not None and not v > 0:
            p.error(f"--{name.replace('_', '-')} must be > 0, got {v}")
    if a.part == "engine":
        try:
            shlex.split(a.engine_args)
        except ValueError as e:
            p.error(f"--engine-args: {e}")
        if a.sim_loads_api != "sglang" and a.sim_worker is None:
            p.error("--sim-loads-api applies to sim-workers: give --sim-worker too")
    a.argv = sys.argv[2:]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks: stop workers, router
    try:
        if a.part == "kv":
            routing_kv.kv_part(a)
        else:
            (sim_part if a.part == "sim" else engine_part)(a)
    except RuntimeError as e:  # a worker or router that would not start or died: its log says why
        sys.exit(f"routing_experiment: {e} (process logs in {a.log_dir})")


if __name__ == "__main__":
    main()
