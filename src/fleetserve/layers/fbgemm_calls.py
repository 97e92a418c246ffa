"""fbgemm's quantized linear ops, resolved once so each call does less Python work.

At one decode token a linear's arithmetic takes tens of microseconds, so what it costs
to *reach* the kernel matters. ``torch.ops.quantized.linear_dynamic_fp16(x, packed)``
goes through the op's ``OpOverloadPacket``, which matches the arguments against the
op's schemas on every call; the resolved overload's own callable (``.default._op``)
skips that. Measured on this project's AVX2 EPYC (``time.process_time`` over 20k calls
of a 64 x 64 linear, 1 thread, machine loaded): 38-45 us through the packet, 22-35 us
through the resolved callable. SmolLM2 runs 121 linears per decode step.

Same op, same kernel, same threading, so the results are equal bit for bit
(``tests/unit/layers/test_fbgemm_calls.py``).

Not used, on purpose: aten's older binding of the same fp16 GEMM
(``torch.fbgemm_linear_fp16_weight``, deprecated) costs only ~6 us per call, but it runs
the GEMM on one thread (``cblas_gemm_compute`` with one thread; per-thread CPU ticks
measured 100/0 for the 3072 x 576 gate/up weight) where the quantized op splits it over
all of ``torch.get_num_threads()`` (50/50). On a loaded machine that looked 3-4x faster
at concurrency 1 (no second thread to wait for), but on a quiet one streaming the
weights from one core instead of two would cost more than the call saves.
"""

from __future__ import annotations

import torch


def _resolved(name: str):
    """``torch.ops.quantized.<name>.default``'s callable, or None without the quantized ops."""
    overload = getattr(getattr(torch.ops.quantized, name, None), "default", None)
    if overload is None:
        return None
    return getattr(overload, "_op", overload)


#: ``quantized::linear_dynamic(x, packed, reduce_range)``: W8A8 dynamic int8 (packed by ``linear_prepack``).
LINEAR_DYNAMIC_INT8 = _resolved("linear_dynamic")
#: ``quantized::linear_dynamic_fp16(x, packed)``: fp16 weights (packed by ``linear_prepack_fp16``).
LINEAR_DYNAMIC_FP16 = _resolved("linear_dynamic_fp16")
