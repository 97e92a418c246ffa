"""Bfloat16 linears on CPUs with AMX (``--quantization bf16_linear``).

On Intel Xeons with AMX (``amx_bf16`` / ``amx_tile`` in ``/proc/cpuinfo``: Sapphire
Rapids and later) oneDNN multiplies bfloat16 tiles in hardware with float32
accumulation. One weight reordered once into oneDNN's blocked bfloat16 layout
(``torch.ops.mkldnn._reorder_linear_weight``) and called through
``torch.ops.mkldnn._linear_pointwise`` -- the pair torch.compile's CPU backend emits
for frozen bf16 linears -- ran SmolLM2's linears 2.8-5.8x faster than float32
``F.linear`` at 32 rows and 1.4-3.2x at one row, one thread (``benchmarks/quant_linear.py``,
docs/benchmarks.md, "bf16 linears on AMX").

What changes against float32: the weight and the linear's input are rounded to bfloat16
(8 significant bits, relative rounding error up to 2^-9), products are accumulated in
float32, and the op's output is rounded to bfloat16 once more (the packed op returns its
input's dtype) before it is widened back to float32: ~3e-3 relative error per linear on
random weights.
Everything outside the linears (norms, rotary, attention, the KV cache, the residual
stream, sampling) stays float32, unlike ``--dtype bfloat16``, which keeps all of it in
bfloat16. Neither SGLang nor vLLM has this mode (their CPU back-ends run the whole model
in ``--dtype bfloat16``); the name is this project's.
"""

from __future__ import annotations

import torch

from fleetserve.layers.cpu_gemm import PACK_BATCH_HINT, packed_linear_ops_available


def available() -> bool:
    """Whether torch has oneDNN's packed linear here (the kernel pair this module calls)."""
    return packed_linear_ops_available()


class Bf16LinearGemm:
    """``y = x @ W.T (+ bias)`` with ``W``, ``x`` and the product rounded to bfloat16 (float32 accumulation).

    Same call signature as :class:`~fleetserve.layers.cpu_gemm.PackedLinear`
    (``gemm(x, weight, bias)``); the ``weight`` argument is ignored (the bfloat16 copy
    reordered at construction is used). ``x``: ``[..., in]``, any float dtype; returns
    ``[..., out]`` in ``x``'s dtype (float32 values that are bfloat16 numbers, plus ``bias``
    added in float32).
    """

    __slots__ = ("_packed", "out_features", "in_features")

    def __init__(self, weight: torch.Tensor) -> None:
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        w = weight.detach().to(torch.bfloat16).contiguous()
        self._packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT)

    def bf16_2d(self, xb: torch.Tensor) -> torch.Tensor:
        """The kernel alone: ``xb`` contiguous bfloat16 ``[rows >= 1, in]`` -> bfloat16 ``[rows, out]``."""
        return torch.ops.mkldnn._linear_pointwise(xb, self._packed, None, "none", [], "")

    def __call__(self, x: torch.Tensor, weight: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        dtype, shape = x.dtype, x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.shape[0] == 0:
            y = x2.new_zeros(0, self.out_features, dtype=torch.float32)
        else:
            y = self.bf16_2d(x2.to(torch.bfloat16).contiguous()).float()
        if bias is not None:
            y = y + bias.float()
        y = y.reshape(*shape[:-1], self.out_features)
        return y if dtype == torch.float32 else y.to(dtype)
