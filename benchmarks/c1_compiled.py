"""Concurrency 1 decode at 1 thread: eager vs compiled (``--enable-torch-compile``), CPU time per step.

One process, one SmolLM2 model (float32 weights, plus ``--quantization`` kernels
switched in per variant, as ``benchmarks/compile_throughput.py`` does), the
compiled runner built for bucket 1 only, once per ``--options`` set of inductor
options. Then ``--rounds`` rounds; in each, every variant (linears x path) runs
``--steps`` decode steps of one request of ``--ctx`` cached tokens, the variants
in rotating order, so machine load hits them alike. Reported per variant: the
median over rounds of the process CPU time per step (``time.process_time``; with
1 thread this is close to a quiet machine's wall time) and of the wall time.

Paths: ``eager`` (today's default: K/V of a lone request read as a pool view),
``eager-gather`` (the same with the K/V ``index_select`` gather forced, i.e.
before the allocator kept a request's slots ascending), ``compiled`` /
``compiled-<opt>`` (the compiled decode step, with the named inductor option set).

Also checks greedy tokens: every variant decodes ``--tokens`` tokens from the
same prompt; the table says whether they equal the float32 (or the same
linears') eager tokens.

Usage::

    python benchmarks/c1_compiled.py [--quantization none,fp16_weight] [--options default,cpp_wrapper]
        [--rounds 3] [--steps 8] [--no-write]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compile_throughput import decode_batch, install_gemm_switches  # noqa: E402

#: Inductor option sets a ``--options`` name stands for.
OPTION_SETS: dict[str, dict[str, object]] = {
    "default": {},
    "cpp_wrapper": {"cpp_wrapper": True},
}

PROMPT = [1, 4093, 314, 253, 1345, 2593, 563, 253, 23946, 23325, 30, 378, 12336, 28]


def greedy(runner, n: int) -> list[int]:
    """Prefill :data:`PROMPT` (eager), then ``n`` greedy decode steps through ``runner.forward``."""
    from fleetserve.core.forward_batch import ForwardBatch, ForwardMode

    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    slots = runner.allocator.alloc(len(PROMPT))
    L = len(PROMPT)
    logits = runner.forward(ForwardBatch(ForwardMode.EXTEND, t(PROMPT), torch.arange(L), slots.clone(), t([L]),
                                         t([0]), t([L]), [slots.clone()]))
    out = [int(logits[-1].argmax())]
    for _ in range(n - 1):
        new = runner.allocator.alloc_extend(int(slots.numel()), int(slots[-1]), 1)
        slots = torch.cat([slots, new])
        L = int(slots.numel())
        logits = runner.forward(ForwardBatch(ForwardMode.DECODE, t([out[-1]]), t([L - 1]), new.clone(), t([L]),
                                             t([L - 1]), t([1]), [slots.clone()]))
        out.append(int(logits[-1].argmax()))
    runner.allocator.free(slots)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quantization", default="none,fp16_weight")
    ap.add_argument("--options", default="default", help=f"inductor option sets, of {sorted(OPTION_SETS)}")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--no-compile", action="store_true", help="eager paths only")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--section", default="engine-c1-compiled-table")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)

    import fleetserve.core.forward_context as forward_context
    import fleetserve.engine.compiled_decode_runner as cdr
    from fleetserve.engine.cuda_graph_runner import default_seq_len_buckets
    from fleetserve.engine.model_runner import ModelRunner

    quants = a.quantization.split(",")
    runner = ModelRunner(None, dtype="float32", max_total_tokens=4096, show_progress=False)
    gemms, switches = install_gemm_switches(runner.model, quants)

    compiled: dict[str, object] = {}
    compile_s: dict[str, float] = {}
    if not a.no_compile:
        for name in a.options.split(","):
            cdr.COMPILE_OPTIONS.clear()
            cdr.COMPILE_OPTIONS.update(OPTION_SETS[name])
            t0 = time.perf_counter()
            runner._init_compiled_runner([1], default_seq_len_buckets(runner.max_context_len))
            compile_s[name] = time.perf_counter() - t0
            compiled[name] = runner.graph_runner
            print(f"compiled bucket 1 with {name} in {compile_s[name]:.0f} s (load {os.getloadavg()[0]:.1f})",
                  flush=True)
        cdr.COMPILE_OPTIONS.clear()
    real_run = forward_context.contiguous_run

    def use(variant: str) -> None:
        q, path = variant.split("/")
        for sw, g in zip(switches, gemms[q]):
            sw.impl = g
        forward_context.contiguous_run = (lambda s: None) if path == "eager-gather" else real_run
        runner.graph_runner = compiled[path.split("-", 1)[1] if "-" in path else "default"] \
            if path.startswith("compiled") else None

    paths = ["eager", "eager-gather"] + [("compiled" if o == "default" else f"compiled-{o}") for o in compiled]
    variants = [f"{q}/{p}" for q in quants for p in paths]
    tokens = {}
    for v in variants:
        use(v)
        tokens[v] = greedy(runner, a.tokens)
    fb, slots = decode_batch(runner, 1, a.ctx)
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    wall: dict[str, list[float]] = {v: [] for v in variants}
    loads = []
    for r in range(a.rounds):
        order = variants[r % len(variants):] + variants[: r % len(variants)]
        for v in order:
            use(v)
            runner.forward(fb)
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(a.steps):
                runner.forward(fb)
            wall[v].append((time.perf_counter() - t0) / a.steps * 1000)
            cpu[v].append((time.process_time() - c0) / a.steps * 1000)
        loads.append(os.getloadavg()[0])
        print(f"round {r + 1}: " + ", ".join(f"{v} {cpu[v][-1]:.1f}" for v in variants)
              + f" CPU ms/step (load {loads[-1]:.1f})", flush=True)
    runner.allocator.free(slots)
    use(variants[0])

    med = {v: statistics.median(cpu[v]) for v in variants}
    rows = []
    for v in variants:
        q = v.split("/")[0]
        ref = f"{q}/eager"
        rows.append(f"| {v} | {med[v]:.1f} | {med[ref] / med[v]:.2f}x | {1000 / med[v]:.1f} | "
                    f"{statistics.median(wall[v]):.1f} | {'yes' if tokens[v] == tokens[ref] else 'no'} | "
                    f"{'yes' if tokens[v] == tokens['none/eager' if 'none' in quants else ref] else 'no'} |")
    opts = "; ".join(f"`{n}` {OPTION_SETS[n] or '{}'}: {compile_s[n]:.0f} s" for n in compiled) or "none"
    body = (f"torch {torch.__version__}, 1 thread, one request of {a.ctx + 1} tokens decoding, {a.steps} steps per "
            f"variant per round, {a.rounds} rounds in rotating order; median per variant. Compiled runner: "
            f"bucket 1 only; start-up compile per option set ({opts}). Load average (1 min) after each round: "
            f"{', '.join(f'{x:.1f}' for x in loads)}. Greedy: {a.tokens} tokens from one prompt, compared "
            "with the same linears' eager tokens and with float32 eager's.\n\n"
            "| linears / path | CPU ms/step | vs its eager | tok/s by CPU time | wall ms/step | same tokens as its eager "
            "| same tokens as float32 eager |\n|---|---:|---:|---:|---:|---|---|\n" + "\n".join(rows) + "\n")
    print(body)
    if not a.no_write:
        from doc_section import write_section

        write_section(a.section, "Concurrency 1 at 1 thread: eager vs compiled decode, CPU time (SmolLM2, CPU)",
                      " ".join(["python benchmarks/c1_compiled.py", *(argv if argv is not None else sys.argv[1:])]),
                      body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
