"""Recompute the hit-rate bounds of a ``routing_experiment.py kv`` results file, split by routed / direct.

The kv results JSON (``benchmarks/results/<section>.json``) keeps, per router row, every request's id,
send time, worker, prompt and cached tokens and whether it went straight to a worker. The requests
themselves are seeded, so this script rebuilds them from the same workload flags, tokenizes them as
the run did (SmolLM2's tokenizer, the chat template) and reports for each row: the measured hit rate,
the infinite-cache bound, the own-worker bound (:func:`routing_kv.split_cache_hits`), with
``--pool-tokens`` the finite-pool bound (:func:`routing_kv.finite_pool_bound`: every worker's pool of that
many tokens together, offline-optimal eviction), and the measured hit rate and own-worker bound for the
routed and the direct requests apart.  Rate-experiment files (``kv --rates``) keep no per-request
records, so they are refused with a message; their pool bound is computed while they run. Prompt lengths are checked against the workers'
reports (``token mismatch`` counts the requests that differ; 0 means the rebuild is exact).

Usage::

    python benchmarks/routing_kv_rebound.py benchmarks/results/routing-kv-split.json foreign \\
        --conversations 24 --turns 5
    python benchmarks/routing_kv_rebound.py benchmarks/results/routing-kv-split.json foreign \\
        --conversations 24 --turns 5 --pool-tokens 16000
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import routing_kv as rk  # noqa: E402

from fleetserve.bench import cli as bench_cli  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", help="a routing_experiment.py kv results JSON")
    p.add_argument("scenario", help="its table, e.g. foreign")
    p.add_argument("--conversations", type=int, required=True)
    p.add_argument("--turns", type=int, required=True)
    p.add_argument("--question-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--system-prompt-len", type=int, default=0, help="the run's --mt-system-len")
    p.add_argument("--pool-tokens", type=int, default=0,
                   help="the run's --max-total-tokens (per worker or DP rank): adds the finite-pool bound")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    from fleetserve.models.tokenizer import tokenizer_dir
    from fleetserve.router.kv_events.tokenize import RouterTokenizer

    t = json.loads(Path(a.results).read_text())
    if "rows" in t:  # a rate-experiment file: one table at the top level, no requests kept
        sys.exit(f"{a.results}: a rate-experiment file keeps no per-request records; nothing to rebuild")
    t = t[a.scenario]
    if t["workload"] != "multi_turn":
        sys.exit("only multi_turn tables are rebuilt (the direct-traffic and replica tables)")
    bargs = bench_cli.build_parser().parse_args(
        ["--workload", "multi_turn", "--num-conversations", str(a.conversations), "--num-turns", str(a.turns),
         "--question-len", str(a.question_len), "--output-len", str(a.output_len),
         "--multi-turn-replies", "synthetic", "--system-prompt-len", str(a.system_prompt_len),
         "--seed", str(a.seed), "--request-rate", str(t["rate"])])
    reqs = {q.rid: q for q in bench_cli.workload_from_args(bargs)}  # the rate only scales arrival times
    caches = t["workers"] * t.get("dp", 1)
    tok = RouterTokenizer(tokenizer_dir())
    for row in t["rows"]:
        recs = sorted(row["requests"], key=lambda r: r["start"])
        workers = sorted({r["worker"] for r in recs})
        prompts = [tok.request_ids("/v1/chat/completions", {"messages": reqs[r["rid"]].messages}) for r in recs]
        dest = [workers.index(r["worker"]) if r["direct"] else None for r in recs]
        own = rk.split_cache_hits(prompts, dest)
        inf_c, total = rk.infinite_cache_bound(prompts)
        parts = {}
        for kind, pick in (("routed", lambda d: d is None), ("direct", lambda d: d is not None)):
            idx = [i for i, d in enumerate(dest) if pick(d)]
            n = sum(len(prompts[i]) for i in idx)
            if n:
                parts[kind] = (sum(recs[i]["cached"] for i in idx) / n, sum(own[i] for i in idx) / n, n)
        hit = sum(r["cached"] for r in recs) / sum(r["prompt"] for r in recs)
        mism = sum(1 for r, q in zip(recs, prompts) if len(q) != r["prompt"])
        pool = ""
        if a.pool_tokens:
            pool_c, _ = rk.finite_pool_bound(prompts, caches * a.pool_tokens)
            pool = f"  pool bound {pool_c / total:6.1%}"
        print(f"{row['label']:<30} run {row.get('rep', 0) + 1}  hit {hit:6.1%}  bound {inf_c / total:6.1%}  "
              f"own-worker bound {sum(own) / total:6.1%}{pool}  token mismatch {mism}")
        for kind, (h, b, n) in parts.items():
            print(f"    {kind:<7} hit {h:6.1%}  own-worker bound {b:6.1%}  ({n} prompt tokens)")


if __name__ == "__main__":
    main()
