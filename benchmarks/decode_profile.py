"""Where one fleetserve decode step's time goes at concurrency 1 (SmolLM2, CPU).

Builds one rank in this process exactly as ``fleetserve serve``'s rank process
does (:func:`fleetserve.engine.rank_builder.build_rank`), runs one greedy
request and times ``--steps`` decode steps twice:

1. plain (no instrumentation): the step's wall time, the reference;
2. with forward hooks on every module and wrappers on the scheduler's parts,
   which split the step into: scheduling (``get_next_batch``), the forward's
   setup (``ForwardContext`` and input copies), the decoder's linears (q/k/v,
   o, gate/up, down), the LM head (logits over the 49k vocabulary), attention
   proper (rotary, KV write, gather, softmax(QK^T)V), RMSNorms, the MLP's
   activation, the embedding, the model's own Python between modules, and
   ``process_batch_result`` (sampling and output bookkeeping). The hooks add
   a little time of their own (shown as the difference of the two totals).

Then, with ``--serve``, the same request through a real ``fleetserve serve``
(HTTP + ZMQ + detokenizer + rank process): the mean inter-token latency of the
stream minus the in-process step time is what the serving path adds per token.
A ``torch.profiler`` table of the top operators (self CPU time) is printed too.

Usage::

    python benchmarks/decode_profile.py [--quantization none] [--threads 2] [--steps 48] [--serve]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _category(mod: torch.nn.Module, name: str) -> str | None:
    from fleetserve.layers.attention import MHAttention
    from fleetserve.layers.linear import (ColumnParallelLinear, ParallelLMHead, RowParallelLinear,
                                          VocabParallelEmbedding)
    from fleetserve.layers.mlp import GatedMLP
    from fleetserve.layers.norm import RMSNorm

    if isinstance(mod, ParallelLMHead):
        return "lm_head (576 -> 49152 logits)"
    if isinstance(mod, (ColumnParallelLinear, RowParallelLinear)):
        return "decoder linears (qkv, o, gate_up, down)"
    if isinstance(mod, MHAttention):
        return "attention proper (rotary, KV write, gather, SDPA)"
    if isinstance(mod, GatedMLP):
        return "MLP activation (SiLU * up)"
    if isinstance(mod, RMSNorm):
        return "RMSNorm"
    if isinstance(mod, VocabParallelEmbedding):
        return "embedding"
    return None


class ExclusiveTimer:
    """Exclusive (self) wall time per category over nested timed calls on one thread."""

    def __init__(self):
        self.total: dict[str, float] = collections.defaultdict(float)
        self._stack: list[list] = []  # [category, start, child time]

    def enter(self, cat: str) -> None:
        self._stack.append([cat, time.perf_counter(), 0.0])

    def exit(self) -> None:
        cat, t0, child = self._stack.pop()
        dt = time.perf_counter() - t0
        self.total[cat] += dt - child
        if self._stack:
            self._stack[-1][2] += dt

    def wrap(self, cat: str, fn):
        def timed(*a, **kw):
            self.enter(cat)
            try:
                return fn(*a, **kw)
            finally:
                self.exit()
        return timed


def instrument(sched, runner, timer: ExclusiveTimer) -> None:
    """Hooks on the model's modules and wrappers on the scheduler / runner (exclusive times)."""
    model = runner.model
    for name, mod in model.named_modules():
        cat = "model Python between modules" if mod is model else _category(mod, name)
        if cat is None:
            continue
        mod.register_forward_pre_hook(lambda m, a, c=cat: timer.enter(c))
        mod.register_forward_hook(lambda m, a, o: timer.exit())
    # compute_logits runs the LM head outside model.forward: its own glue goes to the forward setup
    runner.model.compute_logits = timer.wrap("forward setup (ForwardContext, copies, logits glue)",
                                             runner.model.compute_logits)
    runner.forward = timer.wrap("forward setup (ForwardContext, copies, logits glue)", runner.forward)
    sched.get_next_batch = timer.wrap("scheduling (get_next_batch)", sched.get_next_batch)
    sched.sampler = _Wrapped(sched.sampler, timer.wrap("sampling (greedy argmax + Sampler)", sched.sampler.__call__))
    sched.process_batch_result = timer.wrap("output bookkeeping (process_batch_result)", sched.process_batch_result)
    sched.step = timer.wrap("scheduler step glue", sched.step)


class _Wrapped:
    def __init__(self, inner, call):
        self._inner, self._call = inner, call

    def __call__(self, *a, **kw):
        return self._call(*a, **kw)

    def __getattr__(self, k):
        return getattr(self._inner, k)


def decode_steps(sched, ids: list[int], steps: int, tag: str, timer: "ExclusiveTimer | None" = None) -> list[float]:
    """Add one greedy request, prefill, 4 warm-up decode steps, then ``steps`` timed decode steps (seconds each).

    With ``timer``, its totals are cleared before the timed steps and kept as they were after them."""
    from fleetserve.engine.io_struct import TokenizedGenerateReq
    from fleetserve.engine.sampling_params import SamplingParams

    sched.add_request(TokenizedGenerateReq(tag, ids, SamplingParams(max_new_tokens=steps + 8, temperature=0.0,
                                                                    ignore_eos=True), stream=True))
    for _ in range(5):
        sched.step()
    out = []
    if timer is not None:
        timer.total.clear()
    for _ in range(steps):
        t0 = time.perf_counter()
        sched.step()
        out.append(time.perf_counter() - t0)
    kept = dict(timer.total) if timer is not None else None
    while sched.has_work():
        sched.step()
    if timer is not None:
        timer.total.clear()
        timer.total.update(kept)
    return out


def served_itl(path: str, quantization: str, threads: int, prompt: str, n: int) -> tuple[float, float]:
    """(mean inter-token latency s, TTFT s) of one streaming request to a real ``fleetserve serve``."""
    import serving_systems as ss
    from fleetserve.bench.client import run_requests
    from fleetserve.bench.workloads import BenchRequest

    srv = ss.fleetserve_server(path, quantization, threads)
    try:
        def one(k: int):
            req = BenchRequest(rid=f"p{k}", messages=[{"role": "user", "content": prompt}], prompt_len=8,
                               output_len=k, group="p")
            res, _ = asyncio.run(run_requests(srv.base, [req], api="completions", progress=False, timeout_s=600))
            return res[0]
        one(8)  # warm-up
        r = one(n)
        assert r.success and r.completion_tokens == n, r.error
        return statistics.mean(r.itl), r.ttft
    finally:
        ss.stop(srv)


def linear_weight_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(weights of the decoder's linears, weights of the LM head): element counts of their ``weight``s."""
    from fleetserve.layers.linear import ColumnParallelLinear, ParallelLMHead, RowParallelLinear

    dec = head = 0
    for mod in model.modules():
        w = getattr(mod, "weight", None)
        if not isinstance(w, torch.Tensor):
            continue
        if isinstance(mod, ParallelLMHead):
            head += w.numel()
        elif isinstance(mod, (ColumnParallelLinear, RowParallelLinear)):
            dec += w.numel()
    return dec, head


#: bytes per weight element each way of storing it (GGUF Q4_1: blocks of 32 weights = 16 bytes of
#: nibbles + fp16 scale and min, ggml's block_q4_1; fleetserve's int8 keeps a float scale per row)
BYTES_PER_WEIGHT = {"none": 4.0, "fp16_weight": 2.0, "int8": 1.0, "Q4_1 (llama.cpp)": 20 / 32}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--serve", action="store_true", help="also measure the ITL through fleetserve serve")
    ap.add_argument("--torch-profile", action="store_true", help="print torch.profiler's top operators")
    ap.add_argument("--no-write", action="store_true", help="print only, leave docs/benchmarks.md alone")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from fleetserve.distributed.parallel_state import SINGLE_RANK_STATE
    from fleetserve.engine.args import ServerArgs
    from fleetserve.engine.rank_builder import build_rank
    from fleetserve.models.registry import default_model_path
    from fleetserve.models.tokenizer import load_tokenizer

    path = default_model_path()
    tok = load_tokenizer(path)
    prompt = "Write a short story about a lighthouse keeper."
    ids = tok.encode(prompt)
    rank = build_rank(ServerArgs(model_path=path, dtype="float32", quantization=args.quantization,
                                 max_total_tokens=8192, random_seed=0, torch_num_threads=args.threads),
                      SINGLE_RANK_STATE)
    sched, runner = rank.scheduler, rank.runner
    n_dec, n_head = linear_weight_counts(runner.model)
    decode_steps(sched, ids, 8, "warm")
    plain = decode_steps(sched, ids, args.steps, "plain")

    if args.torch_profile:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            decode_steps(sched, ids, 8, "prof")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))

    timer = ExclusiveTimer()
    instrument(sched, runner, timer)
    hooked = decode_steps(sched, ids, args.steps, "hooked", timer)
    plain_ms, hooked_ms = 1000 * statistics.median(plain), 1000 * statistics.median(hooked)
    per_step = {k: 1000 * v / args.steps for k, v in timer.total.items()}
    tot = sum(per_step.values())
    load = os.getloadavg()
    rows = [
        f"One greedy request (prompt of {len(ids)} tokens), --quantization {args.quantization}, {args.threads} "
        f"threads, {args.steps} decode steps timed after 4 warm-up ones, in one process built as `fleetserve "
        f"serve`'s rank (`build_rank`). Machine load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} "
        f"(1 / 5 / 15 min; {os.cpu_count()} cores shared with other jobs).",
        "",
        f"Decode step, median: **{plain_ms:.1f} ms** uninstrumented ({1000 / plain_ms:.1f} tok/s in-process); "
        f"{hooked_ms:.1f} ms with the module hooks below (their own cost is the difference). Exclusive time "
        f"per part (mean over the timed steps; a module's time excludes its timed children):",
        "",
        "| part of a decode step | ms per step | share |",
        "|---|---:|---:|",
    ]
    for k, v in sorted(per_step.items(), key=lambda kv: -kv[1]):
        rows.append(f"| {k} | {v:.2f} | {100 * v / tot:.1f}% |")
    lin_ms = sum(v for k, v in per_step.items() if k.startswith(("decoder linears", "lm_head")))
    mb = {m: (n_dec + n_head) * b / 1e6 for m, b in BYTES_PER_WEIGHT.items()}
    rows += [
        "",
        f"Weights a decode step reads (decoder linears {n_dec / 1e6:.1f} M + LM head {n_head / 1e6:.1f} M "
        f"elements): " + ", ".join(f"{m}: {v:.0f} MB" for m, v in mb.items())
        + f". At concurrency 1 every token streams all of them once; with --quantization {args.quantization} "
        f"that is {mb.get(args.quantization, float('nan')):.0f} MB in {lin_ms:.1f} ms of linears and LM head, "
        f"{mb.get(args.quantization, float('nan')) / max(lin_ms, 1e-9):.1f} GB/s.",
    ]
    if args.serve:
        del rank, sched, runner
        itl, ttft = served_itl(path, args.quantization, args.threads, prompt, args.steps + 8)
        rows += ["", f"Through `fleetserve serve` (HTTP + ZMQ + detokenizer + the rank process), one streaming "
                 f"request of {args.steps + 8} tokens: mean inter-token latency **{itl * 1000:.1f} ms** "
                 f"({1 / itl:.1f} tok/s), TTFT {ttft * 1000:.0f} ms: the serving path adds "
                 f"{itl * 1000 - plain_ms:.1f} ms per token over the in-process step."]
    text = "\n".join(rows)
    print(text, flush=True)
    if not args.no_write:
        from doc_section import write_section

        cmd = " ".join(["python benchmarks/decode_profile.py", *sys.argv[1:]])
        write_section("engine_decode_profile", "Where a decode step's time goes at concurrency 1 (SmolLM2, CPU)",
                      cmd, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
