"""One SmolLM2 engine whose ``--quantization`` mode can be switched between runs (benchmarks only).

Loading the GGUF takes minutes on a loaded 2-core machine, so the quality and
throughput benchmarks load it once: each mode is applied once with
:func:`fleetserve.layers.quantization.apply_quantization` (from the float32 weights,
which every layer keeps), its per-layer gemm objects are remembered, and
:meth:`ModeSwitcher.use` puts a mode's set back in place. The result is the same
model a fresh engine with ``--quantization mode`` would build.
"""

from __future__ import annotations

from fleetserve.layers.cpu_gemm import PackedLinear
from fleetserve.layers.quantization import _targets, apply_quantization


class ModeSwitcher:
    """Holds, per mode, the gemm object of every quantization target of ``runner.model``."""

    def __init__(self, runner, modes) -> None:
        self.runner = runner
        self.layers = _targets(runner.model)
        self.gemms = {}
        for mode in modes:
            for m in self.layers:
                m._gemm = PackedLinear()
            applied = apply_quantization(runner.model, mode, runner.device)
            assert applied == mode or (mode == "auto"), (mode, applied)
            self.gemms[mode] = [m._gemm for m in self.layers]

    def use(self, mode: str) -> None:
        for m, g in zip(self.layers, self.gemms[mode]):
            m._gemm = g
        self.runner.quantization = mode


def build(modes, max_total_tokens: int = 16384):
    """(scheduler, switcher) for the built-in SmolLM2 in float32 with every mode of ``modes`` ready."""
    from fleetserve.distributed.parallel_state import SINGLE_RANK_STATE
    from fleetserve.engine.args import ServerArgs
    from fleetserve.engine.rank_builder import build_rank
    from fleetserve.models.registry import default_model_path

    args = ServerArgs(model_path=default_model_path(), dtype="float32", max_total_tokens=max_total_tokens,
                      random_seed=0, quantization="none")
    sched = build_rank(args, SINGLE_RANK_STATE).scheduler
    return sched, ModeSwitcher(sched.runner, modes)
