"""fleetserve serve at concurrency 1 (and 8 / 32) before and after a change, next to llama-server.

Issue 16 asks for decode speed at concurrency 1 without losing batch throughput. This runs, in
one process and one sitting, ``fleetserve serve`` from two source trees -- ``base`` (the ``src``
of git revision ``--base-rev``, extracted with ``git archive``) and ``new`` (this checkout) --
for each ``--quantization`` mode in ``--modes``, one mode at a time (two servers up at once), and
llama.cpp's ``llama-server`` (``--llama-server``) on the same GGUF throughout. At every level
the systems take turns, order rotating by round, ``--rounds`` times, so load from other jobs
falls on all of them alike; the table gives the median tok/s over the rounds, new / base, and at
concurrency 1 new / llama-server. Each load average (1 min) is written next to its figure.
The section is rewritten after every mode, so an interrupted run keeps what it measured (modes
not reached show ``-``).

Clients, prompts and the check that every request returns exactly its ``max_tokens`` are those
of the systems benchmark (``serving_systems.measure``: streaming ``/v1/completions``, greedy,
``ignore_eos``, closed loop of *c* requests, a try that got no byte of a response resent and
counted).

Usage::

    python benchmarks/c1_speed_ab.py --base-rev 609e9c5 --llama-server /tmp/llama_build/bin/llama-server \\
        [--modes none,fp16_weight,int8] [--levels 1,8,32] [--rounds 2] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import serving_systems as ss  # noqa: E402
from doc_section import write_section  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def extract_src(rev: str, into: str) -> str:
    """``git archive rev src`` unpacked under ``into``; returns that ``src`` folder."""
    tar = subprocess.run(["git", "-C", ROOT, "archive", rev, "src"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", into], input=tar, check=True)
    return os.path.join(into, "src")


def prompts_for(n: int) -> list[str]:
    topics = ["a lighthouse keeper", "a lost robot", "the first snow", "a market at dawn", "an old map",
              "a river crossing", "a night train", "a quiet library"]
    return [f"Write a short story about {topics[i % len(topics)]} (number {i})." for i in range(n)]


def write(args, argv, results, notes, modes, levels, nreq, rev, head, have_llama) -> None:
    """Print the table of what was measured so far and write it into the doc (unless --no-write)."""
    def med(key):
        v = results.get(key)
        return statistics.median(t for t, _, _ in v) if v else None

    def loads(key):
        return ", ".join(f"{ld:.1f}" for _, ld, _ in results.get(key, [])) or "-"

    def fmt(x):
        return f"{x:.1f}" if x is not None else "-"  # not measured (see the notes for failures)

    rows = ["| --quantization | c | requests | base tok/s | new tok/s | new / base | llama-server tok/s | "
            "new / llama-server | loads (1 min) at each new figure | retries (all systems) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for mode in modes:
        for li, c in enumerate(levels):
            b, n = med((mode, "base", c)), med((mode, "new", c))
            ll = med((mode, "llama.cpp", c)) if c == min(levels) else None
            retr = sum(x for s in ("base", "new", "llama.cpp") for _, _, x in results.get((mode, s, c), []))
            rows.append(f"| {mode} | {c} | {nreq[li]} | {fmt(b)} | {fmt(n)} | "
                        f"{f'{n / b:.2f}x' if b and n else '-'} | {fmt(ll) if c == min(levels) else '-'} | "
                        f"{f'{n / ll:.2f}x' if ll and n else '-'} | {loads((mode, 'new', c))} | {retr} |")
    body = "\n".join([
        f"base = `{rev}`{f' with `{args.base_args}`' if args.base_args else ' (before this change)'}, new = `{head}`"
        f"{f' with `{args.new_args}`' if args.new_args else ''}{f' and env `{args.new_env}`' if args.new_env else ''}; "
        f"{args.threads} threads each "
        f"(`--torch-num-threads {args.threads}`, llama-server `-t {args.threads} -tb {args.threads}`), "
        f"{args.max_new_tokens} output tokens per request, median of {args.rounds} rounds, systems in "
        f"rotating order at each level. llama-server: `{ss.llama_server_version(args.llama_server) if have_llama else 'not run'}`"
        f", the same GGUF (Q4_1 as is).", "", *rows, "", *[f"Note: {x}" for x in notes]])
    print(body)
    if not args.no_write:
        cmd = "python benchmarks/c1_speed_ab.py " + " ".join(argv if argv is not None else sys.argv[1:])
        write_section(args.section, "Concurrency 1 before / after, next to llama-server (SmolLM2, CPU, A/B)",
                      cmd, body)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-rev", required=True, help="git revision whose src is the 'base' server")
    ap.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER", ""))
    ap.add_argument("--modes", default="none,fp16_weight,int8")
    ap.add_argument("--levels", default="1,8,32")
    ap.add_argument("--requests", default="4,16,32", help="requests per level")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--section", default="engine-c1-speed-ab")
    ap.add_argument("--new-args", default="", help="more `fleetserve serve` flags for the new server only "
                                                   "(e.g. '--enable-torch-compile --torch-compile-max-bs 1')")
    ap.add_argument("--base-args", default="", help="more `fleetserve serve` flags for the base server only")
    ap.add_argument("--new-env", default="", help="environment for the new server only, `KEY=VALUE,...` "
                                                  "(e.g. 'TORCHINDUCTOR_CPP_WRAPPER=1')")
    ap.add_argument("--start-timeout", type=float, default=600, help="seconds a server may take to start")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)

    from fleetserve.models.registry import default_model_path

    path = default_model_path()
    levels = [int(x) for x in args.levels.split(",")]
    nreq = [int(x) for x in args.requests.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    rev = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", args.base_rev], check=True,
                         capture_output=True, text=True).stdout.strip()
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], check=True,
                          capture_output=True, text=True).stdout.strip()
    tmp = tempfile.mkdtemp(prefix="c1ab-")
    base_src = extract_src(args.base_rev, tmp)
    llama = ss.llama_server(args.llama_server, path, args.threads, parallel=max(levels), ctx_per_slot=512)
    results: dict[tuple[str, str, int], list[tuple[float, float, int]]] = {}  # (mode, system, c) -> [(tps, load, retries)]
    notes: list[str] = []
    try:
        for mode in modes:
            new_env = dict(kv.split("=", 1) for kv in args.new_env.split(",") if kv)
            servers = {"base": ss.fleetserve_server(path, mode, args.threads, wait=False, src=base_src,
                                                    name=f"base {mode}", extra_args=shlex.split(args.base_args)),
                       "new": ss.fleetserve_server(path, mode, args.threads, wait=False, name=f"new {mode}",
                                                   extra_args=shlex.split(args.new_args), extra_env=new_env)}
            try:
                for srv in servers.values():
                    ss.wait_ready(srv, args.start_timeout)
                for name, srv in servers.items():
                    ss.measure(srv.base, prompts_for(2), [4, 4], 2, f"warm-{name}")
                for li, c in enumerate(levels):
                    systems = list(servers) + (["llama.cpp"] if llama is not None and c == min(levels) else [])
                    for r in range(args.rounds):
                        k = (r + li) % len(systems)
                        for name in systems[k:] + systems[:k]:
                            base_url = llama.base if name == "llama.cpp" else servers[name].base
                            try:
                                res = ss.measure(base_url, prompts_for(nreq[li]), [args.max_new_tokens] * nreq[li],
                                                 c, f"{mode}-{name}-c{c}-r{r}")
                            except RuntimeError as e:
                                notes.append(f"{mode} {name} c={c} round {r}: failed ({str(e).splitlines()[0][:200]})")
                                print(notes[-1], flush=True)
                                continue
                            load = os.getloadavg()[0]
                            results.setdefault((mode, name, c), []).append((res.tps, load, res.retries))
                            print(f"{mode:>12} c={c:>2} round {r} {name:>9}: {res.tps:6.1f} tok/s  "
                                  f"(load {load:.1f}, retries {res.retries})", flush=True)
            finally:
                for srv in servers.values():
                    ss.stop(srv)
            write(args, argv, results, notes, modes, levels, nreq, rev, head, llama is not None)  # partial, kept
    finally:
        if llama is not None:
            ss.stop(llama)

    return 0


if __name__ == "__main__":
    sys.exit(main())
