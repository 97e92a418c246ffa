"""Float32 matmuls on CPU through oneDNN with a prepacked weight.

On this project's CPU machines (AMD EPYC, AVX2, no AMX) torch's default
``F.linear`` goes to MKL's sgemm, which is slow for the small row counts of
decode (8-32 tokens): the SmolLM2 LM head (``[49152, 576]``) took ~1.5-2x as long
through MKL as through oneDNN with the weight reordered once into oneDNN's
blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, then
``torch.ops.mkldnn._linear_pointwise`` -- the same pair torch.compile's CPU
backend emits for frozen linears). See docs/benchmarks.md, "Engine throughput".

The packed copy is made lazily on the first inference-mode call and rebuilt
whenever the weight changes (tracked by its storage pointer and in-place
version counter), so weight loaders can keep writing ``module.weight``.
It costs one extra copy of the weight in memory.

Results are float32 like MKL's, with a different summation order (differences
of order 1e-6 relative); the parity tests against transformers cover them.

Only calls with ``MIN_ROWS <= rows <= MAX_ROWS`` take this path (decode and
small prefills); measured on the same machine, MKL was as fast or faster outside.

Set ``FLEETSERVE_ONEDNN_LINEAR=0`` to turn this off (plain ``F.linear``).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

#: Batch-size hint for oneDNN's weight layout (decode batches are 1..32 tokens
#: here; measured, the layout picked for 32 was as good or better at 1 and 8).
PACK_BATCH_HINT = 32

#: Fewer rows than this go to plain ``F.linear``: at one decode token MKL's
#: matrix-vector path was faster than oneDNN here.
MIN_ROWS = 4
#: More rows than this (prefill) also go to ``F.linear``: for 384- and
#: 1000-token prefills MKL was ~5% faster, and at 64 decode rows the two were even.
MAX_ROWS = 128


def packed_linear_ops_available() -> bool:
    """Whether torch has oneDNN's weight reorder and packed linear (also used by ``bf16_linear``)."""
    try:
        return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise") \
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    except (AttributeError, RuntimeError):
        return False


def _available() -> bool:
    if os.environ.get("FLEETSERVE_ONEDNN_LINEAR", "1") in ("0", "false", "no"):
        return False
    return packed_linear_ops_available()


ENABLED = _available()


class PackedLinear:
    """``y = x @ weight.T (+ bias)`` for one weight, through oneDNN when it can.

    Use: keep one instance per weight; call ``packed(x, weight, bias)``.
    Falls back to ``F.linear`` when autograd is on, off CPU, for non-float32
    tensors, or when oneDNN is unavailable or disabled. ``x`` is ``[N, in]``
    (or ``[..., in]``, flattened); returns ``[..., out]`` float32.
    """

    __slots__ = ("_key", "_packed", "_failed")

    def __init__(self) -> None:
        self._key = None
        self._packed: torch.Tensor | None = None
        self._failed = False

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return self._traced(x, weight, bias)
        if (not ENABLED or self._failed or x.device.type != "cpu" or x.dtype != torch.float32
                or weight.dtype != torch.float32 or torch.is_grad_enabled() or x.dim() != 2
                or not MIN_ROWS <= x.shape[0] <= MAX_ROWS):
            return F.linear(x, weight, bias)
        try:
            key = (weight.data_ptr(), weight._version, tuple(weight.shape))
        except RuntimeError:  # an inference tensor has no version counter: cannot see updates, do not pack
            return F.linear(x, weight, bias)
        if key != self._key:
            try:
                self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)
            except RuntimeError:
                self._failed = True
                return F.linear(x, weight, bias)
            self._key = key
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self._packed, bias, "none", [], "")

    @staticmethod
    def _traced(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The call as torch.compile traces it when the layer has no opaque-gemm handle: plain
        ``F.linear`` (the packed copy cannot go into a traced graph). ``--enable-torch-compile``
        registers its layers (:mod:`fleetserve.layers.opaque_gemm`), so its graph calls this
        object eagerly instead."""
        return F.linear(x, weight, bias)
