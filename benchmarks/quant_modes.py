"""One SmolLM2 engine whose ``--quantization`` mode can be switched between runs (benchmarks only).

Loading the GGUF takes minutes on a loaded 2-core machine, so the quality and
throughput benchmarks load it once: each mode is applied once with
:func:`fleetserve.layers.quantization.apply_quantization` (from the float32 weights,
which every layer keeps), its per-layer gemm objects are remembered, and
:meth:`ModeSwitcher.use` puts a mode's set back in place. The result is the same
model a fresh engine with ``--quantization mode`` would build. ``int8`` smooths (SmoothQuant, folded
into the RMSNorm weights, which are therefore switched too); ``INT8_VARIANTS`` switch its two parts off
for comparison (``int8-plain`` is the int8 before them).
"""

from __future__ import annotations

from fleetserve.layers.cpu_gemm import PackedLinear
from fleetserve.layers.norm import RMSNorm
from fleetserve.layers.quantization import _targets, apply_quantization
from fleetserve.layers.smooth_quant import restore_norms

#: Benchmark-only int8 variants (no such ``--quantization`` values): ``int8-plain`` = one
#: activation scale per call, no SmoothQuant (the int8 before them); ``int8-smooth`` = SmoothQuant
#: only; ``int8-token`` = per-token activation scales only. ``int8`` = both. ``int8-resact`` = ``int8``
#: with two-term (residual) activations; ``int8-res`` = two-term activations and weights
#: (``Int8DynamicGemm(act_passes=2, weight_passes=2)``; issue 16, ``benchmarks/int8_sensitivity.py``).
#: ``int8-head`` = fp16 weights for the decoder linears (``fp16_weight``) and an int8 LM head whose
#: top 16 logits per row are recomputed in float32 (``fleetserve.layers.rescored_head``).
INT8_VARIANTS = ("int8-plain", "int8-smooth", "int8-token", "int8-resact", "int8-res", "int8-head")
#: Benchmark-only ``bf16_linear`` variants: ``bf16_linear-f32head`` = bfloat16 decoder linears and the
#: float32 LM head; ``bf16_linear-plainhead`` = a plain bfloat16 head (``bf16_linear`` before its head's
#: top 16 logits were recomputed in float32, :class:`fleetserve.layers.rescored_head.RescoredHead`).
BF16_VARIANTS = ("bf16_linear-f32head", "bf16_linear-plainhead")
#: variant -> (smoothing, per_token, act_passes, weight_passes)
_VARIANT_ARGS = {"": (True, True, 1, 1), "plain": (False, False, 1, 1), "smooth": (True, False, 1, 1),
                 "token": (False, True, 1, 1), "resact": (True, True, 2, 1), "res": (True, True, 2, 2)}


class ModeSwitcher:
    """Holds, per mode, the gemm object of every quantization target of ``runner.model``."""

    def __init__(self, runner, modes) -> None:
        self.runner = runner
        self.layers = _targets(runner.model)
        self.gemms, self.norms = {}, {}
        self.norm_layers = [m for m in runner.model.modules() if isinstance(m, RMSNorm)]
        for mode in modes:
            for m in self.layers:
                m._gemm = PackedLinear()
            base, _, variant = mode.partition("-") if mode.startswith(("int8-", "bf16_linear-")) else (mode, "", "")
            if base == "bf16_linear":
                from fleetserve.layers.bf16_gemm import Bf16LinearGemm
                from fleetserve.layers.linear import ParallelLMHead

                assert apply_quantization(runner.model, "bf16_linear", runner.device) == "bf16_linear"
                for m in self.layers:
                    if isinstance(m, ParallelLMHead) and variant == "f32head":
                        m._gemm = PackedLinear()
                    elif isinstance(m, ParallelLMHead) and variant == "plainhead":
                        m._gemm = Bf16LinearGemm(m.weight)
            elif variant == "head":
                from fleetserve.layers.linear import ParallelLMHead
                from fleetserve.layers.rescored_head import RescoredInt8Head

                assert apply_quantization(runner.model, "fp16_weight", runner.device) == "fp16_weight"
                for m in self.layers:
                    if isinstance(m, ParallelLMHead):
                        m._gemm = RescoredInt8Head(m.weight)
            else:
                smoothing, per_token, ap, wp = _VARIANT_ARGS[variant]
                applied = apply_quantization(runner.model, base, runner.device, calibrate=runner.int8_calibrator(),
                                             smoothing=smoothing, per_token=per_token, act_passes=ap,
                                             weight_passes=wp)
                assert applied == base or (mode == "auto"), (mode, applied)
            self.gemms[mode] = [m._gemm for m in self.layers]
            self.norms[mode] = [n.weight.detach().clone() for n in self.norm_layers]  # int8 folds s into them
        restore_norms(runner.model)

    def use(self, mode: str) -> None:
        for m, g in zip(self.layers, self.gemms[mode]):
            m._gemm = g
        for n, w in zip(self.norm_layers, self.norms[mode]):
            n.weight.data.copy_(w)
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
