"""The eager decode fast path on and off, side by side in one process (SmolLM2, CPU).

Builds one rank per ``--quantization`` mode in this process, as ``fleetserve
serve``'s rank process does (:func:`fleetserve.engine.rank_builder.build_rank`),
then, round after round, runs the same greedy requests with
:data:`fleetserve.core.fast_path.ENABLED` flipped on and off (the order
alternates every round), timing every decode step. Interleaving keeps both
sides under the same machine load, so their ratio means something on a
shared machine even when the absolute figures do not.

Also checks that both sides produce the same greedy tokens.

Usage::

    python benchmarks/decode_fast_path.py [--quantization none,fp16_weight] [--batch 1,8] [--threads 2]
        [--steps 32] [--rounds 3] [--no-write]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

PROMPTS = ["Write a short story about a lighthouse keeper.", "List three facts about the moon.",
           "Explain how a bicycle works.", "What is the capital of France?", "Give me a recipe for pancakes.",
           "Describe the water cycle.", "Why is the sky blue?", "Tell me a joke about computers."]


def run_batch(sched, prompts: list[list[int]], steps: int, tag: str) -> tuple[list[tuple[float, float]], dict]:
    """Add ``len(prompts)`` greedy requests of ``steps + 2`` tokens, run them to the end; return
    ``(wall s, process CPU s)`` of every step in which all of them decode together, and each one's tokens."""
    from fleetserve.engine.io_struct import TokenizedGenerateReq
    from fleetserve.engine.sampling_params import SamplingParams

    rids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, ids in zip(rids, prompts):
        sched.add_request(TokenizedGenerateReq(rid, ids, SamplingParams(max_new_tokens=steps + 2, temperature=0.0,
                                                                        ignore_eos=True), stream=True))
    toks: dict[str, list[int]] = {r: [] for r in rids}
    times: list[tuple[float, float]] = []
    while sched.has_work():
        full = len(sched.running) == len(prompts) and not sched.waiting
        t0, c0 = time.perf_counter(), time.process_time()
        outs = sched.step()
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        if full:
            times.append((dt, dc))
        for o in outs:
            toks[o.rid] += o.new_token_ids
    return times[1:], {r.split("-", 1)[1]: t for r, t in toks.items()}  # the first full step may hold a prefill


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quantization", default="none,fp16_weight")
    ap.add_argument("--batch", default="1,8", help="concurrent requests per measurement (comma list)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from fleetserve.core import fast_path
    from fleetserve.distributed.parallel_state import SINGLE_RANK_STATE
    from fleetserve.engine.args import ServerArgs
    from fleetserve.engine.rank_builder import build_rank
    from fleetserve.models.registry import default_model_path
    from fleetserve.models.tokenizer import load_tokenizer

    path = default_model_path()
    tok = load_tokenizer(path)
    ids = [tok.encode(p) for p in PROMPTS]
    modes = args.quantization.split(",")
    batches = [int(b) for b in args.batch.split(",")]
    ranks = {m: build_rank(ServerArgs(model_path=path, dtype="float32", quantization=m, max_total_tokens=16384,
                                      random_seed=0, torch_num_threads=args.threads), SINGLE_RANK_STATE).scheduler
             for m in modes}
    for sched in ranks.values():
        run_batch(sched, ids[:1], 4, "warm")
    load0 = os.getloadavg()
    times: dict[tuple, list[tuple[float, float]]] = {}
    tokens: dict[tuple, dict] = {}
    for rnd in range(args.rounds):
        for b in batches:
            prompts = [ids[i % len(ids)] for i in range(b)]
            for m in modes:
                for fast in ((True, False) if rnd % 2 == 0 else (False, True)):
                    fast_path.ENABLED = fast
                    t, out = run_batch(ranks[m], prompts, args.steps, f"r{rnd}")
                    times.setdefault((m, b, fast), []).extend(t)
                    tokens.setdefault((m, b, fast), out)
    fast_path.ENABLED = True
    load1 = os.getloadavg()
    rows = [
        f"Greedy requests of {args.steps + 2} tokens, {args.threads} threads, {args.rounds} rounds; each round runs "
        f"every (mode, batch) with the fast path on and off back to back (order alternating per round), in one "
        f"process built as `fleetserve serve`'s rank. Step time = one scheduler step while the whole batch "
        f"decodes (median over all rounds). Machine load average {load0[0]:.1f} at the start, {load1[0]:.1f} at "
        f"the end (1 min; {os.cpu_count()} cores shared with other jobs). CPU ms = the process's CPU "
        f"time per step (all its threads, spinning included): on a loaded machine the wall time mostly "
        f"measures waiting for a core; the CPU time (with 1 thread) is nearer a quiet machine's wall time, though "
        f"other jobs' memory traffic still inflates it.",
        "",
        "| --quantization | requests | off: wall ms/step | on: wall ms/step | wall speed-up | off: CPU ms/step "
        "| on: CPU ms/step | CPU speed-up | on: tok/s by CPU time | same tokens |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for m in modes:
        for b in batches:
            off = [1000 * statistics.median(x[i] for x in times[(m, b, False)]) for i in (0, 1)]
            on = [1000 * statistics.median(x[i] for x in times[(m, b, True)]) for i in (0, 1)]
            same = tokens[(m, b, False)] == tokens[(m, b, True)]
            rows.append(f"| {m} | {b} | {off[0]:.1f} | {on[0]:.1f} | {off[0] / on[0]:.2f}x | {off[1]:.1f} | "
                        f"{on[1]:.1f} | {off[1] / on[1]:.2f}x | {1000 * b / on[1]:.1f} | {'yes' if same else 'NO'} |")
    text = "\n".join(rows)
    print(text, flush=True)
    if not args.no_write:
        from doc_section import write_section

        cmd = " ".join(["python benchmarks/decode_fast_path.py", *sys.argv[1:]])
        write_section("engine_decode_fast_path", "Eager decode fast path on vs off (SmolLM2, CPU)", cmd, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
