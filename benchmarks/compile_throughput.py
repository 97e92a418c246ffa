"""Decode throughput of SmolLM2, eager vs ``--enable-torch-compile``, float32 and fp16 weights, in one run.

Two measurements, each with the variants side by side (same process, same
prompts, the variants taking turns at each level so machine noise hits them alike):

* decode step: ``ModelRunner.forward`` on one DECODE batch of ``bs`` requests
  (every request 64 tokens in, KV width 256), mean over ``--steps`` steps after
  warm-up; reported as ms/step and decode tokens/s (``bs / step time``);
* engine: the in-process scheduler (as ``benchmarks/quant_throughput.py``), a
  closed loop of greedy requests at concurrency 1, 8, 32, output tokens/s.

The compiled runner is built with buckets ``1, 8, 32`` only (the default list,
``1, 2, 4, 8, 16, 24, 32``, would compile seven graphs); a batch between two
buckets is padded to the next one.

One model serves every variant, so the buckets compile once: the variant sets the
runner's ``graph_runner`` (the compiled runner, or None for eager) and the linears'
``_gemm`` objects (float32 oneDNN/MKL, or ``--quantization fp16_weight``'s fbgemm
kernels). That is what a fresh compile of each variant would run: the compiled graph
calls every linear's ``_gemm`` through the opaque ``fleetserve::gemm`` op
(``layers/opaque_gemm.py``), whose body reads the layer's ``_gemm`` at run time.
``--profile`` prints torch.profiler's top ops of one step of each variant at the largest batch.

Usage::

    python benchmarks/compile_throughput.py               # writes docs/benchmarks.md
    python benchmarks/compile_throughput.py --no-write --quantization none --profile
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_throughput import prompts_for  # noqa: E402
from quant_throughput import closed_loop  # noqa: E402

BUCKETS = [1, 8, 32]


class GemmSwitch:
    """A layer's ``_gemm`` that calls ``impl`` (the variant's kernel object)."""

    def __init__(self, impl):
        self.impl = impl

    def __call__(self, x, weight, bias=None):
        return self.impl(x, weight, bias)


def install_gemm_switches(model, quants) -> tuple[dict[str, list], list[GemmSwitch]]:
    """Quantize ``model`` once per mode in ``quants`` and give every linear one :class:`GemmSwitch`.

    Returns ``(gemms, switches)``: ``gemms[mode]`` is the list of every linear's gemm under that
    mode ("none" = float32), in module order; ``switches`` the per-linear switches, set to "none".
    Each layer's ``_gemm`` is set once, before compiling, to a switch the variants flip: setting a
    module attribute after compiling could invalidate dynamo's guards on the module (a recompile)."""
    from fleetserve.layers.quantization import apply_quantization

    layers = [m for m in model.modules() if hasattr(m, "_gemm")]
    gemms = {"none": [m._gemm for m in layers]}
    for q in quants:
        if q != "none":
            apply_quantization(model, q, "cpu")
            gemms[q] = [m._gemm for m in layers]
    switches = [GemmSwitch(g) for g in gemms["none"]]
    for m, sw in zip(layers, switches):
        m._gemm = sw
    return gemms, switches


def decode_batch(runner, bs: int, ctx: int = 64):
    """Allocate ``bs`` requests of ``ctx`` cached tokens and return (DECODE ForwardBatch, slots to free)."""
    from fleetserve.core.forward_batch import ForwardBatch, ForwardMode

    slots = runner.allocator.alloc(bs * (ctx + 1))
    per = slots.view(bs, ctx + 1)
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    seq = t([ctx + 1] * bs)
    fb = ForwardBatch(mode=ForwardMode.DECODE, input_ids=t([(17 * i) % 1000 + 5 for i in range(bs)]),
                      positions=t([ctx] * bs), out_cache_loc=per[:, -1].clone(), seq_lens=seq,
                      extend_prefix_lens=seq - 1, extend_seq_lens=torch.ones(bs, dtype=torch.int64),
                      kv_indices=[per[i].clone() for i in range(bs)])
    return fb, slots


def step_ms(runner, fb, steps: int) -> float:
    for _ in range(2):
        runner.forward(fb)
    t0 = time.perf_counter()
    for _ in range(steps):
        runner.forward(fb)
    return (time.perf_counter() - t0) / steps * 1000


def inductor_cache_state(path: str | None = None) -> tuple[str, str]:
    """``(cache dir, "cold" | "warm (N files)")`` of inductor's on-disk cache, read before compiling.

    ``path``: the directory (default: inductor's own, i.e. ``$TORCHINDUCTOR_CACHE_DIR`` or
    ``/tmp/torchinductor_<user>``). "cold" = missing or without a file; a warm cache lets the
    compile skip code generation and the C++ builds (dynamo still traces every bucket)."""
    if path is None:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        path = cache_dir()
    n = sum(len(files) for _, _, files in os.walk(path)) if os.path.isdir(path) else 0
    return path, (f"warm ({n} files)" if n else "cold")


def median_run(runs: list[tuple]) -> tuple:
    """Of ``closed_loop`` results ``(tok/s, mean TTFT s, tokens, load)``: the run of median tok/s
    (the lower middle one for an even count), so its TTFT, tokens and load belong to the same run."""
    return sorted(runs, key=lambda r: r[0])[(len(runs) - 1) // 2]


def lscpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except Exception:
        return "unknown CPU"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--buckets", default=",".join(map(str, BUCKETS)), help="compiled buckets = batch sizes measured")
    ap.add_argument("--quantization", default="none,fp16_weight", help="linears of the variants (comma list)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--no-engine", action="store_true", help="decode-step table only")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--rounds", type=int, default=1, help="engine runs per level and variant (rotating order; median)")
    ap.add_argument("--section", default="compile_throughput",
                    help="docs/benchmarks.md section to (re)write (a new name is appended at the end)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    buckets = [int(x) for x in a.buckets.split(",")]
    quants = a.quantization.split(",")

    from fleetserve.distributed.parallel_state import SINGLE_RANK_STATE
    from torch._dynamo.utils import counters

    from fleetserve.engine.args import ServerArgs
    from fleetserve.engine.cuda_graph_runner import default_seq_len_buckets
    from fleetserve.engine.model_runner import ModelRunner
    from fleetserve.engine.rank_builder import build_rank
    from fleetserve.models.registry import default_model_path
    from fleetserve.models.tokenizer import load_tokenizer

    path = default_model_path()
    cache_path, cache_state = inductor_cache_state()
    print(f"inductor cache {cache_path}: {cache_state}", flush=True)
    t0 = time.perf_counter()
    runner = ModelRunner(path, dtype="float32", max_total_tokens=16384, show_progress=False)
    gemms, switches = install_gemm_switches(runner.model, quants)
    t_compile = time.perf_counter()
    runner._init_compiled_runner(buckets, default_seq_len_buckets(runner.max_context_len))
    compile_s = time.perf_counter() - t0
    compiled_runner = runner.graph_runner
    per_bucket = ", ".join(f"{b}: {sec:.0f} s" for b, sec in compiled_runner.compile_seconds.items())
    print(f"built in {compile_s:.0f} s (compile {time.perf_counter() - t_compile:.0f} s; per bucket {per_bucket}), "
          f"load {os.getloadavg()[0]:.1f}", flush=True)
    load_at_compile = os.getloadavg()[0]
    torch._logging.set_logs(recompiles=True)
    graphs = counters["stats"]["unique_graphs"]

    def use(name: str) -> None:
        q, kind = name.split("/")
        for sw, g in zip(switches, gemms[q]):
            sw.impl = g
        runner.graph_runner = compiled_runner if kind == "compiled" else None

    names = [f"{q}/{kind}" for q in quants for kind in ("eager", "compiled")]

    def ratio(name: str, value: dict[str, float], faster_is_lower: bool) -> float:
        ref = value[name.split("/")[0] + "/eager"]
        return ref / value[name] if faster_is_lower else value[name] / ref

    step_rows = []
    for bs in buckets:
        ms = {}
        fb, slots = decode_batch(runner, bs)
        for name in names:
            use(name)
            ms[name] = step_ms(runner, fb, a.steps)
        runner.allocator.free(slots)
        for name in names:
            step_rows.append((bs, name, ms[name], bs / ms[name] * 1000, ratio(name, ms, True)))
            print(f"decode bs={bs:>2} {name:>22}: {ms[name]:7.1f} ms/step  {bs / ms[name] * 1000:7.1f} tok/s  "
                  f"({ratio(name, ms, True):.2f}x its eager)  load {os.getloadavg()[0]:.1f}", flush=True)

    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        fb, slots = decode_batch(runner, buckets[-1])
        for name in names:
            use(name)
            runner.forward(fb)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(3):
                    runner.forward(fb)
            print(f"--- profile {name}, 3 steps at batch {buckets[-1]}")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
        runner.allocator.free(slots)

    engine_rows = []
    if not a.no_engine:
        tok = load_tokenizer(path)
        args = ServerArgs(model_path=path, dtype="float32", max_total_tokens=16384, random_seed=0)
        sched = build_rank(args, SINGLE_RANK_STATE, runner=runner).scheduler
        for name in names:
            use(name)
            closed_loop(sched, [tok.encode(p) for p in prompts_for(2)], 2, 4, "warm")
        for c in [int(x) for x in a.concurrency.split(",")]:
            n = max(4, c)
            ids = [tok.encode(t) for t in prompts_for(n)]
            runs: dict[str, list] = {name: [] for name in names}
            for r in range(a.rounds):  # rotating order: round r starts at variant r
                for name in names[r % len(names):] + names[:r % len(names)]:
                    use(name)
                    sched.flush_cache()
                    runs[name].append((*closed_loop(sched, ids, c, a.max_new_tokens, name.replace("/", "_")),
                                       os.getloadavg()[0]))
            res = {name: median_run(rs) for name, rs in runs.items()}
            tps = {name: r[0] for name, r in res.items()}
            for name in names:
                same = res[name][2] == res[name.split("/")[0] + "/eager"][2]
                engine_rows.append((c, n, name, tps[name], ratio(name, tps, False), res[name][1], same,
                                    tps[name] / tps["none/eager"] if "none/eager" in tps else float("nan"),
                                    res[name][3]))
                print(f"engine c={c:>2} {name:>22}: {tps[name]:7.1f} tok/s ({ratio(name, tps, False):.2f}x its eager), "
                      f"TTFT {res[name][1] * 1000:6.0f} ms, tokens == its eager: {same}  "
                      f"load {os.getloadavg()[0]:.1f}", flush=True)

    recompiles = counters["stats"]["unique_graphs"] - graphs
    print(f"graphs compiled while measuring: {recompiles}", flush=True)
    rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    load = os.getloadavg()
    body = (f"{lscpu_model()}; 2 cores shared with other jobs (noisy: compare within a row). "
            f"torch {torch.__version__}, {a.threads} threads. Compiled runner: buckets {buckets}, KV width "
            f"dynamic (the batch's longest sequence, as eager), linears and collectives opaque custom ops; "
            f"start-up {compile_s:.0f} s (load + compiling every bucket once; the variants share the model "
            f"and its graphs; {recompiles} graphs compiled while measuring). Inductor cache before "
            f"compiling: {cache_state} (`{cache_path}`); compile per bucket: {per_bucket} (load "
            f"{load_at_compile:.1f} when it ended). Peak RSS {rss_gib:.1f} GiB. Load average at the end (1/5/15 min): "
            f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}.\n\n"
            f"Decode step (`ModelRunner.forward`, {a.steps} steps, every request 65 tokens long; ratio against "
            "the same linears eager):\n\n"
            "| batch | linears / step | ms/step | decode tok/s | vs eager |\n|---|---|---|---|---|\n")
    body += "\n".join(f"| {b} | {n} | {m:.1f} | {t:.1f} | {r:.2f}x |" for b, n, m, t, r in step_rows) + "\n"
    if engine_rows:
        body += (f"\nEngine closed loop ({a.max_new_tokens} greedy tokens per request, ignore_eos; variants "
                 f"interleaved per level, {a.rounds} round(s) in rotating order, the median round's figures; "
                 "'vs eager float32' = tok/s / none/eager's at the same level):\n\n"
                 "| concurrency | requests | linears / step | output tok/s | vs eager | vs eager float32 "
                 "| mean TTFT (ms) | tokens == eager | load (1 min) |\n"
                 "|---|---|---|---|---|---|---|---|---|\n")
        body += "\n".join(f"| {c} | {n} | {m} | {t:.1f} | {r:.2f}x | {r32:.2f}x | {tt * 1000:.0f} | "
                          f"{'yes' if s else 'no'} | {ld:.1f} |"
                          for c, n, m, t, r, tt, s, r32, ld in engine_rows) + "\n"
    print(body)
    if not a.no_write:
        from doc_section import write_section

        write_section(a.section, "Decode with --enable-torch-compile vs eager (SmolLM2, CPU)",
                      " ".join(["python benchmarks/compile_throughput.py", *(argv if argv is not None else sys.argv[1:])]),
                      body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
