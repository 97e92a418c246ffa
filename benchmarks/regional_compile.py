"""Compile cost of --torch-compile-region step vs layer (run by hand; set an empty
TORCHINDUCTOR_CACHE_DIR for a cold compile). Prints, per region: start-up compile seconds,
dynamo's unique graph count, and batch-1 decode ms per token (eager row for reference).

    python benchmarks/regional_compile.py MODEL_DIR [--steps N]
"""

import argparse
import time

import torch
from torch._dynamo.utils import counters

from fleetserve.engine.model_runner import ModelRunner


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--steps", type=int, default=32)
    a = p.parse_args()
    import sys
    sys.path.insert(0, "tests")
    from helpers.batch_driver import greedy_generate

    for region in (None, "step", "layer"):
        kw = {} if region is None else dict(enable_torch_compile=True, graph_batch_sizes=[1],
                                            torch_compile_region=region)
        before = counters["stats"]["unique_graphs"]
        t0 = time.perf_counter()
        r = ModelRunner(a.model, dtype="float32", max_total_tokens=1024, show_progress=False, **kw)
        start = time.perf_counter() - t0
        compile_s = sum(r.graph_runner.compile_seconds.values()) if region else 0.0
        greedy_generate(r, [[5, 9, 14, 3, 7]], 4)
        t0 = time.perf_counter()
        toks = greedy_generate(r, [[5, 9, 14, 3, 7]], a.steps)
        ms = (time.perf_counter() - t0) * 1e3 / a.steps
        print(f"{region or 'eager'}: start {start:.1f} s, compile {compile_s:.1f} s, "
              f"unique graphs {counters['stats']['unique_graphs'] - before}, {ms:.2f} ms/token, "
              f"tokens {toks[0][:8]}", flush=True)
        del r
        torch._dynamo.reset()


if __name__ == "__main__":
    main()
