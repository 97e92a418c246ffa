"""Router overhead: fleetserve router vs sglang-router vs smg vs no router, in one run.

Uses the shared measuring stick ``../shared/bench/router-overhead`` (4 fake
workers on loopback, wrk with a Lua script sending 200 different 1-2 KB
bodies that share prefixes, CPU accounting from /proc).  Each repeat runs the
direct baseline and then every router in turn, so the routers see the same
machine conditions.  Then it times one cache_aware routing decision (match +
insert of a 4 KB prompt on a tree of >= 2^20 characters) in-process.

    python benchmarks/router_overhead.py                       # 3 repeats, c=16,128, cache_aware
    python benchmarks/router_overhead.py --repeats 1 --duration 5 --no-write
    python benchmarks/router_overhead.py --decision-only
    python benchmarks/router_overhead.py --kv-aware             # + kv_aware with --tokenizer-path (SmolLM2)

``--kv-aware`` adds three more fleetserve targets: ``--policy kv_aware
--tokenizer-path <the built-in SmolLM2's tokenizer>`` with the router's fast
byte-level BPE encoder (``fleetserve-kv_aware``), the same plus
``--tokenizer-cache-enable-l0`` (``fleetserve-kv_aware-l0``), and with
``FLEETSERVE_ROUTER_FAST_TOKENIZE=0``, i.e. ``tokenizers.Tokenizer.encode``
(``fleetserve-kv_aware-libtok``).  The fake workers publish no KV events, so
kv_aware routes in its fallback branch (the approximate tree, over token ids)
and every request is tokenized: this measures tokenization + kv_aware's
bookkeeping, not event handling.

Needs ``wrk`` (Debian) and the peers venv ``/tmp/peers`` with sglang-router and
smg (``--install`` lets the stick's run_bench.sh install both).  Writes the
``router-overhead`` section of docs/benchmarks.md through doc_section.py.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
# ../shared beside a checkout, or ../../shared beside a worktree in a folder of worktrees
STICK = Path(os.environ.get("ROUTER_BENCH_DIR") or next(
    (p for p in (REPO.parent / "shared" / "bench" / "router-overhead",
                 REPO.parent.parent / "shared" / "bench" / "router-overhead") if p.is_dir()),
    REPO.parent / "shared" / "bench" / "router-overhead"))
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "src"))


def ours_template() -> str:
    return (f"{sys.executable} -m fleetserve.cli router --host {{host}} --port {{port}} --worker-urls {{workers}} "
            f"--policy {{policy}} --prometheus-host {{host}} --prometheus-port {{metrics_port}} --log-level warn")


def smollm2_tokenizer_dir() -> str:
    """The built-in model's tokenizer directory (tokenizer.json + config + chat template), converted once."""
    from fleetserve.models.tokenizer import tokenizer_dir

    return tokenizer_dir()


def kv_templates(tokenizer_dir: str) -> list[str]:
    """``NAME=TEMPLATE`` entries for the stick: kv_aware with the fast encoder and with the library's."""
    t = ours_template().replace("--policy {policy}", f"--policy kv_aware --tokenizer-path {shlex.quote(tokenizer_dir)}")
    return [f"fleetserve-kv_aware={t}", f"fleetserve-kv_aware-l0={t} --tokenizer-cache-enable-l0",
            f"fleetserve-kv_aware-libtok=FLEETSERVE_ROUTER_FAST_TOKENIZE=0 {t}"]


FIXED_POLICY = {"fleetserve-kv_aware": "kv_aware", "fleetserve-kv_aware-l0": "kv_aware",
                "fleetserve-kv_aware-libtok": "kv_aware"}


def run_stick(args) -> dict:
    out = Path(args.out_dir)
    extra = []
    if args.kv_aware:
        for entry in kv_templates(smollm2_tokenizer_dir()):
            extra += ["--router", entry]
    cmd = [str(STICK / "run_bench.sh"), "--routers", args.peers, "--router", f"fleetserve={ours_template()}", *extra,
           "--policies", args.policies, "--concurrency", args.concurrency, "--duration", str(args.duration),
           "--repeats", str(args.repeats), "--no-direct-k", "--out-dir", str(out)]
    env = dict(os.environ)
    if not args.install:
        env["SKIP_INSTALL"] = "1"
    env.setdefault("ROUTER_PACKAGES", "sglang-router smg")
    print("+", " ".join(shlex.quote(c) for c in cmd), flush=True)
    subprocess.run(cmd, check=True, env=env, cwd=STICK, timeout=args.max_minutes * 60)
    return json.loads((out / "results.json").read_text())


def _runs(rows, key, nd=0):
    return " / ".join("-" if r.get(key) is None else f"{r[key]:.{nd}f}" for r in rows)


def _med(rows, key):
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def _spread(rows) -> float:
    """Largest max/min ratio of req/s between repeats of one (target, policy, concurrency)."""
    groups: dict[tuple, list] = {}
    for r in rows:
        groups.setdefault((r["target"], r["policy"], r["concurrency"]), []).append(r["rps"])
    return max((max(v) / max(min(v), 1e-9) for v in groups.values() if len(v) > 1), default=1.0)


def overhead_table(results: dict) -> str:
    groups: dict[tuple, list] = {}
    for r in results["rows"]:
        groups.setdefault((r["target"], r["policy"], r["concurrency"]), []).append(r)
    order = {"direct-1": 0, "fleetserve": 1, "fleetserve-kv_aware": 2, "fleetserve-kv_aware-l0": 3,
             "fleetserve-kv_aware-libtok": 4, "sglang-router": 5, "smg": 6}
    lines = ["| router | policy | conc | req/s (each run) | req/s median | p50 ms median | p99 ms (each run) "
             "| p99 ms median | errors | router CPU µs/req (each run) | router CPU µs/req median "
             "| cpu1 busy % median | requests per worker (last run) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (target, policy, conc), rows in sorted(groups.items(), key=lambda kv: (kv[0][2], order.get(kv[0][0], 9),
                                                                               kv[0][1])):
        med_cpu = _med(rows, "router_cpu_us_per_req")
        busy = statistics.median(r["cpu_busy_pct"]["cpu1"] for r in rows)
        lines.append(
            f"| {target} | {policy or FIXED_POLICY.get(target, '-')} | {conc} | {_runs(rows, 'rps')} | {_med(rows, 'rps'):.0f} "
            f"| {_med(rows, 'p50_ms'):.2f} | {_runs(rows, 'p99_ms', 2)} | {_med(rows, 'p99_ms'):.2f} "
            f"| {sum(r['errors'] for r in rows)} | {_runs(rows, 'router_cpu_us_per_req')} "
            f"| {'-' if med_cpu is None else f'{med_cpu:.0f}'} | {busy:.0f} "
            f"| {'/'.join(str(x) for x in rows[-1].get('worker_served') or [])} |")
    fails = results.get("failures") or []
    if fails:
        lines.append("")
        lines.append("Failed to start or run: " + "; ".join(f"{f.get('target')} {f.get('policy')}" for f in fails))
    return "\n".join(lines)


def time_decision(tree_chars: int = 1 << 20, prompt_chars: int = 4096, n: int = 3000, seed: int = 0) -> dict:
    """Median/p99 µs of one cache_aware decision (match + insert) of a 4 KB prompt on a >= 2^20-char tree."""
    from fleetserve.router.policies import CacheAwarePolicy
    from fleetserve.router.workers import Worker

    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz ,.ABCDEFGHIJ0123456789你好世界😀"

    def text(k):
        return "".join(rng.choices(alphabet, k=k))

    groups = [text(prompt_chars // 2) for _ in range(32)]
    policy = CacheAwarePolicy()
    workers = [Worker(f"http://w{i}") for i in range(4)]
    while policy.tree.total_size < tree_chars:
        policy.select(workers, rng.choice(groups) + text(prompt_chars // 2))
    start_size = policy.tree.total_size
    prompts = [rng.choice(groups) + text(prompt_chars // 2) for _ in range(n)]
    ts = []
    for i, p in enumerate(prompts):
        if i % 50 == 0:
            policy.tree.evict(tree_chars)  # untimed: keep the tree near its nominal size
        t0 = time.perf_counter()
        policy.select(workers, p)
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return {"median_us": ts[n // 2] * 1e6, "p99_us": ts[int(n * 0.99)] * 1e6, "tree_start": start_size,
            "tree_end": policy.tree.total_size, "n": n, "hits": policy.hits, "misses": policy.misses}


def _cpu_model() -> str:
    """lscpu's model name (or platform.processor()), for the table's setup line."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    import platform

    return platform.processor() or "unknown"


def time_tokenize(bodies_path: Path, tokenizer_dir: str, rounds: int = 5) -> dict:
    """CPU µs per prompt of ``tokenizers.Tokenizer.encode`` vs the router's fast encoder on the stick's bodies.

    Both run in this process, interleaved, ``rounds`` times over every body after one warm-up pass; the
    fastest round of each counts (the least disturbed by other jobs).  Raises if their ids ever differ.
    """
    from fleetserve.router.kv_events.tokenize import RouterTokenizer

    tok = RouterTokenizer(tokenizer_dir)
    if tok.fast is None:
        raise RuntimeError(f"no fast encoder for {tokenizer_dir}")
    prompts = [json.loads(line)["prompt"] for line in bodies_path.read_text().splitlines() if line.strip()]
    for p in prompts:
        if tok.fast.encode(p) != tok.tokenizer.encode(p).ids:
            raise RuntimeError("the fast encoder's ids differ from the library's")
    runs = {"library": lambda p: tok.tokenizer.encode(p).ids, "fast": tok.fast.encode}
    best = {k: float("inf") for k in runs}
    for _ in range(rounds):
        for k, f in runs.items():
            t0 = time.process_time()
            for p in prompts:
                f(p)
            best[k] = min(best[k], (time.process_time() - t0) / len(prompts) * 1e6)
    best["n"] = len(prompts)
    best["tokens"] = statistics.median(len(tok.fast.encode(p)) for p in prompts)
    # cold: text never seen (random characters, ASCII and not), each encoder fresh, one pass
    rng = random.Random(1)
    alphabet = "abcdefghijklmnopqrstuvwxyz      ,.;'ABCDEFGHIJ0123456789\néàü你好世界😀"
    novel = ["".join(rng.choices(alphabet, k=1500)) for _ in range(len(prompts))]
    for k in ("library", "fast"):
        fresh = RouterTokenizer(tokenizer_dir)
        f = fresh.fast.encode if k == "fast" else (lambda p, t=fresh.tokenizer: t.encode(p).ids)
        t0 = time.process_time()
        for p in novel:
            f(p)
        best["cold_" + k] = (time.process_time() - t0) / len(novel) * 1e6
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--duration", type=float, default=10)
    ap.add_argument("--concurrency", default="16,128")
    ap.add_argument("--policies", default="cache_aware")
    ap.add_argument("--peers", default="sglang-router,smg", help="the stick's presets to compare against")
    ap.add_argument("--out-dir", default="/tmp/fleetserve-router-overhead")
    ap.add_argument("--install", action="store_true", help="let run_bench.sh install wrk and the peers venv")
    ap.add_argument("--max-minutes", type=float, default=30)
    ap.add_argument("--kv-aware", action="store_true",
                    help="also run fleetserve --policy kv_aware --tokenizer-path <SmolLM2> (fast and library encoder)")
    ap.add_argument("--decision-only", action="store_true")
    ap.add_argument("--no-write", action="store_true", help="print, do not write docs/benchmarks.md")
    ap.add_argument("--results", metavar="DIR",
                    help="render the tables from DIR/results.json of an earlier run (given as --out-dir) instead of "
                         "running the stick")
    args = ap.parse_args(argv)

    load_before = os.getloadavg()
    body = []
    if not args.decision_only:
        if args.results:
            results = json.loads((Path(args.results) / "results.json").read_text())
            args.out_dir = args.results
            a = results["meta"]["args"]
            args.duration, args.repeats = a["duration"], a["repeats"]
            args.kv_aware = any(r["target"] in FIXED_POLICY for r in results["rows"])
        else:
            results = run_stick(args)
        load_after = os.getloadavg()
        meta = results["meta"]
        body.append(overhead_table(results))
        body.append("")
        body.append(
            f"Setup: the stick in `../shared/bench/router-overhead` with {meta['args']['workers']} fake workers "
            f"(`--impl {meta['args']['worker_impl']}`, no delay), wrk pinned to cpu0, router and workers to cpu1, "
            f"{args.duration:.0f} s per run, {args.repeats} repeats interleaved (each repeat: direct, then every "
            f"router). Bodies: POST {meta['args']['endpoint']}, 200 bodies of 1-2 KB in 10 prefix groups. "
            f"Versions: {json.dumps(meta.get('versions', {}))}.")
        body.append("")
        spread = _spread(results["rows"])
        loads = (f"1-minute load average {load_before[0]:.1f} when the table was rendered from the run's "
                 f"results.json" if args.results else
                 f"1-minute load average {load_before[0]:.1f} before, {load_after[0]:.1f} after")
        body.append(
            f"Noise: this 2-core machine (lscpu: {_cpu_model()}) was shared with other engineers' builds and tests "
            f"while it ran ({loads}). req/s is what each "
            f"target got of a contended core: the same target's req/s varied by up to {spread:.1f}x between "
            f"repeats of this run. Router CPU µs/req (CPU time of the router's processes / requests) is the "
            f"steadier figure for comparing routers; the median over repeats is the best single value.")
        if args.kv_aware:
            tdir = smollm2_tokenizer_dir()
            t = time_tokenize(Path(args.out_dir) / "bodies.jsonl", tdir)
            body.append("")
            body.append(
                "kv_aware rows: `--policy kv_aware --tokenizer-path` the built-in SmolLM2-135M's tokenizer "
                "(byte-level BPE, 49152 ids). The fake workers publish no KV events, so every decision takes "
                "the fallback branch (the approximate radix tree over the token ids) and no event handling is "
                "measured; what is measured is tokenizing every request plus kv_aware's bookkeeping (tree over "
                "ids, token loads, route header). `fleetserve-kv_aware` uses the router's fast encoder "
                "(`fast_bpe.py`, the default), `fleetserve-kv_aware-l0` adds `--tokenizer-cache-enable-l0` "
                "(sglang-router's exact-text cache, off by default; the stick's 200 bodies repeat, so after "
                "warm-up every request hits it: an upper bound, not a typical workload), "
                "`fleetserve-kv_aware-libtok` is the default router with "
                "`FLEETSERVE_ROUTER_FAST_TOKENIZE=0` (`tokenizers.Tokenizer.encode` on a thread). sglang-router "
                "and smg's cache_aware do not tokenize (they route on the text), so the fair reading is: "
                "kv_aware's req/s next to their cache_aware's.")
            body.append("")
            body.append(
                f"Tokenization alone, in one process, on the same {t['n']} bodies (median {t['tokens']:.0f} "
                f"tokens): `Tokenizer.encode` {t['library']:.0f} µs CPU per prompt, the fast encoder "
                f"{t['fast']:.0f} µs ({t['library'] / t['fast']:.1f}x less; identical ids checked on every body; "
                f"best of 5 interleaved rounds, warm caches: every body of the stick repeats, so this is the "
                f"steady state of a workload whose words and segments were seen before). On text never seen "
                f"(1500 random characters, ASCII and not, each encoder fresh, one pass): {t['cold_library']:.0f} vs "
                f"{t['cold_fast']:.0f} µs ({t['cold_library'] / t['cold_fast']:.1f}x).")
    d = time_decision()
    body.append("")
    body.append(f"One cache_aware routing decision (match + insert, 4096-char prompt whose first half is shared with "
                f"earlier prompts, 4 workers, tree of {d['tree_start']:,} chars, evicted back to 2^20 every 50 decisions, {d['tree_end']:,} at the end): "
                f"median {d['median_us']:.1f} µs, p99 {d['p99_us']:.1f} µs over {d['n']} decisions "
                f"({d['hits']} hits, {d['misses']} misses, counting the tree fill).")
    text = "\n".join(body)
    print(text)
    if not args.no_write:
        from doc_section import write_section

        given = list(argv or sys.argv[1:])
        if args.results:  # name the run the figures came from, not the re-rendering
            i = given.index("--results")
            del given[i:i + 2]
        cmd = "python benchmarks/router_overhead.py " + " ".join(shlex.quote(a) for a in given)
        write_section("router-overhead", "Router overhead: fleetserve router vs sglang-router vs smg", cmd.strip(),
                      text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
