"""Where a full decode step's time goes at concurrency ``--batch`` (SmolLM2, CPU, in-process).

``benchmarks/decode_profile.py`` splits a batch-1 step by module; this one looks at the steady
state of a big batch, where issue 16's concurrency-32 aim lives: one rank is built as
``fleetserve serve`` builds it (:func:`fleetserve.engine.rank_builder.build_rank`, with
``--quantization`` and optionally ``--enable-torch-compile``), ``--batch`` greedy requests are
added at once, ``--warm-steps`` steps run (prefill and the first decode steps), then
``--steps`` decode steps are timed with every request running (ms per step and tok/s), and
``--profile-steps`` more run under ``torch.profiler``, whose top operators by self CPU time are
printed. Prints only (the tables in docs/benchmarks.md that cite it were copied by hand).

Usage::

    python benchmarks/decode_step_profile.py --quantization bf16_linear [--compile] [--batch 32]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_throughput import prompts_for  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--compile", action="store_true", help="--enable-torch-compile (buckets up to --batch)")
    att = ap.add_mutually_exclusive_group()
    att.add_argument("--fused-attention", dest="fused", action="store_const", const=True, default=None,
                     help="compiled step: attention as fused reductions over the pool (attention.FUSED_DECODE_ATTENTION, "
                          "the default)")
    att.add_argument("--sdpa-attention", dest="fused", action="store_const", const=False,
                     help="compiled step: SDPA over a gathered copy of the KV (the form before; the A/B)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warm-steps", type=int, default=20)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--profile-steps", type=int, default=20)
    ap.add_argument("--rows", type=int, default=25, help="operators shown")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)

    from fleetserve.distributed.parallel_state import SINGLE_RANK_STATE
    from fleetserve.engine.args import ServerArgs
    from fleetserve.engine.io_struct import TokenizedGenerateReq
    from fleetserve.engine.rank_builder import build_rank
    from fleetserve.engine.sampling_params import SamplingParams
    from fleetserve.models.registry import default_model_path
    from fleetserve.models.tokenizer import load_tokenizer

    if a.fused is not None:
        from fleetserve.layers import attention
        attention.FUSED_DECODE_ATTENTION = a.fused
    tok = load_tokenizer(default_model_path())
    args = ServerArgs(model_path=default_model_path(), dtype="float32", max_total_tokens=16384, random_seed=0,
                      quantization=a.quantization, enable_torch_compile=a.compile, torch_compile_max_bs=a.batch)
    sched = build_rank(args, SINGLE_RANK_STATE).scheduler
    total = a.warm_steps + a.steps + a.profile_steps + 8
    for i, ids in enumerate(tok.encode(t) for t in prompts_for(a.batch)):
        sched.add_request(TokenizedGenerateReq(f"r{i}", ids, SamplingParams(max_new_tokens=total, temperature=0.0,
                                                                             ignore_eos=True)))
    for _ in range(a.warm_steps):
        sched.step()
    if len(sched.running) != a.batch:
        raise SystemExit(f"only {len(sched.running)} of {a.batch} requests running after the warm-up steps")
    t0 = time.perf_counter()
    for _ in range(a.steps):
        sched.step()
    dt = (time.perf_counter() - t0) / a.steps
    print(f"--quantization {a.quantization}{' --enable-torch-compile' if a.compile else ''}, {a.threads} threads: "
          f"{dt * 1000:.1f} ms per decode step of {a.batch} -> {a.batch / dt:.0f} tok/s", flush=True)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(a.profile_steps):
            sched.step()
    print(f"torch.profiler over {a.profile_steps} steps (self CPU time, all threads' time on this one):")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
