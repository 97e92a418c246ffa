"""Decode throughput of the built-in SmolLM2 with each ``--quantization`` mode, in one run.

For every mode (``none`` = float32, ``int8``, ``fp16_weight``, ``bf16_linear``, ``int8wo``,
``int4wo-32``) the in-process engine (the real scheduler + model runner, as
``benchmarks/engine_throughput.py``; one model, its linears switched between modes by
``quant_modes.py``) runs a closed loop of greedy requests at each concurrency (``c`` requests in
flight, ``--max-new-tokens`` each, ``ignore_eos``); the modes take turns at each
level so machine noise hits them alike. Reported: output tokens/s, mean TTFT,
and the share of generated tokens equal to float32's at the same position
(greedy, same prompts).

Usage::

    python benchmarks/quant_throughput.py              # writes docs/benchmarks.md
    python benchmarks/quant_throughput.py --quick      # small run, prints only
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_throughput import prompts_for  # noqa: E402

MODES = ("none", "int8", "fp16_weight", "bf16_linear", "int8wo", "int4wo-32")


def closed_loop(sched, prompt_ids: list[list[int]], conc: int, max_new: int, tag: str):
    """Returns (output tok/s, mean TTFT s, {prompt index: token ids})."""
    from fleetserve.engine.io_struct import TokenizedGenerateReq
    from fleetserve.engine.sampling_params import SamplingParams

    pending = list(enumerate(prompt_ids))
    t_add, ttft, outs, inflight = {}, {}, {}, set()
    tokens = 0
    t0 = time.perf_counter()
    while pending or inflight:
        while pending and len(inflight) < conc:
            i, ids = pending.pop(0)
            rid = f"{tag}-{conc}-{i}"
            sched.add_request(TokenizedGenerateReq(rid, ids, SamplingParams(max_new_tokens=max_new, temperature=0.0,
                                                                            ignore_eos=True), stream=True))
            t_add[rid], outs[rid] = time.perf_counter(), []
            inflight.add(rid)
        for o in sched.step():
            if o.new_token_ids and o.rid not in ttft:
                ttft[o.rid] = time.perf_counter() - t_add[o.rid]
            tokens += len(o.new_token_ids)
            outs[o.rid].extend(o.new_token_ids)
            if o.finished:
                inflight.discard(o.rid)
    dt = time.perf_counter() - t0
    by_index = {int(rid.rsplit("-", 1)[1]): ids for rid, ids in outs.items()}
    return tokens / dt, statistics.mean(ttft.values()), by_index


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--requests-per-level", type=int, default=0, help="default: max(4, 2 x concurrency); -1: one wave (= concurrency)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--section", default="quant_throughput", help="docs/benchmarks.md section to write")
    a = ap.parse_args(argv)
    if a.quick:
        a.max_new_tokens, a.concurrency, a.no_write = 8, "1,4", True
    torch.set_num_threads(a.threads)
    modes = ["none"] + [m for m in a.modes.split(",") if m != "none"]

    from fleetserve.core.cpu_features import cpu_flags
    from fleetserve.models.registry import default_model_path
    from fleetserve.models.tokenizer import load_tokenizer
    from quant_modes import build

    tok = load_tokenizer(default_model_path())
    sched, switch = build(modes)
    for mode in modes:
        switch.use(mode)
        closed_loop(sched, [tok.encode(p) for p in prompts_for(2)], 2, 4, "warm")
    rows = []
    for c in [int(x) for x in a.concurrency.split(",")]:
        n = c if a.requests_per_level < 0 else (a.requests_per_level or max(4, 2 * c))
        ids = [tok.encode(t) for t in prompts_for(n)]
        res = {}
        for mode in modes:
            switch.use(mode)
            sched.flush_cache()
            res[mode] = closed_loop(sched, ids, c, a.max_new_tokens, mode)
        ref = res["none"][2]
        for mode in modes:
            tps, ttft, outs = res[mode]
            same = sum(x == y for i in ref for x, y in zip(ref[i], outs[i]))
            total = sum(len(v) for v in ref.values())
            rows.append((c, n, mode, tps, tps / res["none"][0], ttft, same / total))
            print(f"c={c} n={n} {mode:>11}: {tps:7.1f} tok/s ({tps / res['none'][0]:.2f}x) "
                  f"TTFT {ttft * 1000:6.0f} ms, tokens = float32's: {same / total:.1%}", flush=True)
    flags = sorted(cpu_flags() & {"avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16",
                                   "amx_bf16", "amx_int8"})
    body = (f"torch {torch.__version__}, {a.threads} threads, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
            f"flags: {', '.join(flags)}. {a.max_new_tokens} greedy output tokens per request (ignore_eos), "
            "closed loop; modes interleaved per level; \"= float32\" is the share of output tokens equal to "
            "float32's at the same position.\n\n"
            "| concurrency | requests | --quantization | output tok/s | vs none | mean TTFT (ms) | = float32 |\n"
            "|---|---|---|---|---|---|---|\n")
    body += "\n".join(f"| {c} | {n} | {m} | {t:.1f} | {r:.2f}x | {tt * 1000:.0f} | {s:.1%} |"
                      for c, n, m, t, r, tt, s in rows) + "\n"
    body += ("\n`int8-plain` / `int8-smooth` / `int8-token`: benchmark-only variants of `int8` (one activation scale "
             "per call without smoothing = the int8 before SmoothQuant; SmoothQuant only; per-token scales only; "
             "`benchmarks/quant_modes.py`). Machine load average at the end: "
             f"{' / '.join(f'{x:.1f}' for x in os.getloadavg())} (1 / 5 / 15 min).\n")
    print(body)
    if not a.no_write:
        from doc_section import write_section

        write_section(a.section, "Engine decode throughput by --quantization (SmolLM2, CPU)",
                      " ".join(["python benchmarks/quant_throughput.py"] + sys.argv[1:]), body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
