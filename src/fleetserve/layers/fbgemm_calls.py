"""The fbgemm linear kernels called with the least Python work per call.

At one decode token a linear's arithmetic takes tens of microseconds, so what it
costs to *reach* the kernel matters: calling ``torch.ops.quantized.linear_dynamic_fp16``
through its ``OpOverloadPacket`` resolves the overload and converts the packed-weight
``ScriptObject`` on every call, ~25-30 us each on this project's AVX2 EPYC (measured
with ``time.process_time`` over 20k calls of a 64 x 64 linear, 1 thread: 30 us through
the packet, 6 us through the aten function below). SmolLM2 runs 121 linears per decode
step, so that was ~3.5 ms of CPU per token.

* :func:`pack_fp16` / :func:`linear_fp16`: aten's own binding of the same fbgemm fp16
  GEMM (``torch.fbgemm_pack_gemm_matrix_fp16`` / ``torch.fbgemm_linear_fp16_weight``:
  the packed ``fbgemm::PackedGemmMatrixFP16`` held in a plain tensor). Same kernel, same
  blocking, so the results equal ``torch.ops.quantized.linear_dynamic_fp16``'s bit for
  bit (``tests/unit/layers/test_fbgemm_calls.py``). torch marks the pair deprecated; when
  a build drops it, :data:`ATEN_FP16` is False and the quantized op is used instead.
* :data:`LINEAR_DYNAMIC_INT8`: the ``.default`` overload of ``quantized::linear_dynamic``,
  resolved once at import (saves the per-call packet lookup).
"""

from __future__ import annotations

import warnings

import torch

# torch warns once per process that the aten pair is deprecated; the fallback below covers removal.
warnings.filterwarnings("ignore", message=r"fbgemm_(pack_gemm_matrix_fp16|linear_fp16_weight).*deprecated")


def _aten_fp16_works() -> bool:
    try:
        w = torch.ones(8, 8)
        packed = torch.fbgemm_pack_gemm_matrix_fp16(w)
        y = torch.fbgemm_linear_fp16_weight(torch.ones(1, 8), packed, torch.zeros(8))
        return bool(torch.equal(y, torch.full((1, 8), 8.0)))
    except (AttributeError, RuntimeError):
        return False


#: True when aten's fp16 pair runs here (fbgemm built in and the functions still shipped).
ATEN_FP16: bool = _aten_fp16_works()

#: ``quantized::linear_dynamic.default`` (W8A8 dynamic int8), or None without the quantized ops.
LINEAR_DYNAMIC_INT8 = getattr(getattr(torch.ops.quantized, "linear_dynamic", None), "default", None)
_LINEAR_DYNAMIC_FP16 = getattr(getattr(torch.ops.quantized, "linear_dynamic_fp16", None), "default", None)


class PackedFp16:
    """One float32 weight ``[out, in]`` rounded to float16 and packed for fbgemm.

    ``packed``: aten's packed tensor when :data:`ATEN_FP16`, else the
    ``quantized::linear_prepack_fp16`` object; ``zero_bias``: float32 ``[out]`` zeros
    (the aten function takes a bias tensor).
    """

    __slots__ = ("packed", "zero_bias", "aten")

    def __init__(self, weight: torch.Tensor) -> None:
        w = weight.detach().float().contiguous()
        self.aten = ATEN_FP16
        if self.aten:
            self.packed = torch.fbgemm_pack_gemm_matrix_fp16(w)
            self.zero_bias = torch.zeros(w.shape[0], dtype=torch.float32)
        else:
            self.packed = torch.ops.quantized.linear_prepack_fp16(w, None)
            self.zero_bias = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W16.T``: ``x`` float32 ``[N, in]`` contiguous, ``N >= 1``; returns float32 ``[N, out]``."""
        if self.aten:
            return torch.fbgemm_linear_fp16_weight(x, self.packed, self.zero_bias)
        return _LINEAR_DYNAMIC_FP16(x, self.packed)
