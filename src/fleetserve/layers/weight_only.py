"""Weight-only integer linears (``--quantization int8wo`` / ``int4wo-<group>``): int weights, float32 activations.

Names follow SGLang's ``--torchao-config`` values (``int8wo``, ``int4wo-32`` ...
``int4wo-256``, group sizes ``[32, 64, 128, 256]`` as SGLang's
``torchao_utils.apply_torchao_config_to_model_`` accepts); the kernels are aten's, so
torchao is not needed.

* ``int8wo``: symmetric int8, one scale per output row, ``scale_o = max|W[o, :]| / 127``,
  ``q = round(W / scale)`` in ``[-127, 127]``. ``y = (x @ q.T) * scale``: the int8
  weight is converted to float32 at each call and multiplied with float32 ``F.linear``
  (aten's ``_weight_int8pack_mm`` computes the same but measured 10-40x slower than
  this on an AVX2-only CPU, docs/benchmarks.md "Int8 linears vs float32").
  Per-element error at most ``scale_o / 2``.
* ``int4wo-<g>``: asymmetric 4-bit per group of ``g`` input columns,
  ``scale = (max - min) / 15``, ``q = round((W - min) / scale)`` in ``[0, 15]``,
  ``W ~ q * scale + min``. This is llama.cpp's Q4_1 rule (``d = (max - min) / 15``,
  ``m = min``, groups of 32), so on a model dequantized from a Q4_1 GGUF (the built-in
  SmolLM2) ``int4wo-32`` finds the file's own codes again and the weights equal the
  float32 ones to float32 rounding. Kernel: aten's ``_weight_int4pack_mm_for_cpu`` on
  the ``_convert_weight_to_int4pack_for_cpu`` packing, which dequantizes
  ``(q - 8) * scale + zero``, so ``zero = min + 8 * scale``. It needs the output rows
  in multiples of 16 (rows are zero-padded here) and ``in_features`` a multiple of
  ``g`` (else ``ValueError`` naming ``--quantization``). Per-element error at most
  ``scale / 2``. From ``INT4_DEQUANT_ROWS`` input rows on, the weight is instead
  dequantized to float32 at the call and multiplied with ``F.linear`` (same weights; on an
  AVX2-only EPYC the aten int4 kernel measured 3-4x slower than that at 32 rows, and
  faster at 1 row).

Under TP each rank quantizes its own shard. Column shards hold whole rows, so they
quantize exactly like the matching rows of the whole weight. A row-parallel shard holds
part of every row: for ``int8wo`` the row maxima are all-reduced (MAX) over the TP group
first, so every shard gets the whole row's scale; for ``int4wo`` a shard is a run of
whole groups when ``in_features / tp`` is a multiple of ``g``. Either way the sharded
quantized weights are the unsharded quantized weights, cut.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

#: Group sizes accepted after ``int4wo-`` (SGLang's ``--torchao-config int4wo-<g>`` list).
INT4_GROUP_SIZES = (32, 64, 128, 256)
#: From this many rows of ``x`` on, int4wo multiplies by the dequantized weight (see the module doc).
INT4_DEQUANT_ROWS = 16
_INT4_ROW_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu: "expect N to be dividable by 16"


def int8_row_absmax(weight: torch.Tensor, group: Any = None, size: int = 1) -> torch.Tensor:
    """``max|W[o, :]|`` per row ``[out]`` float32; with ``size > 1`` the MAX over the TP ``group``."""
    amax = weight.detach().float().abs().amax(dim=1)
    if size > 1:
        import torch.distributed as dist

        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


def quantize_int8_rows(weight: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 of ``weight [out, in]``: ``(q int8 [out, in], scale float32 [out])``.

    ``amax`` (``[out]``) overrides the row maxima (the whole row's, for a row-parallel shard);
    rows of zeros get scale 1. ``W ~ q * scale[:, None]``.
    """
    w = weight.detach().float()
    if amax is None:
        amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def quantize_int4_groups(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit per ``group_size`` columns (llama.cpp Q4_1's rule) of ``weight [out, in]``.

    Returns ``(q uint8 [out, in] in 0..15, scale float32 [out, in / g], minimum float32 [out, in / g])``
    with ``W ~ q * scale + minimum`` per group; a constant group gets scale 1 (``q = 0``).
    Raises ``ValueError`` (naming ``--quantization``) when ``in`` is not a multiple of ``group_size``.
    """
    out_f, in_f = weight.shape
    if in_f % group_size:
        raise ValueError(f"--quantization int4wo-{group_size}: a linear has {in_f} input features (per rank), "
                         f"not a multiple of the group size {group_size}; use a smaller group or int8wo")
    w = weight.detach().float().reshape(out_f, in_f // group_size, group_size)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    scale = (hi - lo) / 15.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((w - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8)
    return q.reshape(out_f, in_f), scale.contiguous(), lo.contiguous()


def _finish(y: torch.Tensor, shape: torch.Size, out_features: int, dtype: torch.dtype,
            bias: torch.Tensor | None) -> torch.Tensor:
    if bias is not None:
        y = y + bias.float()
    y = y.reshape(*shape[:-1], out_features)
    return y if dtype == torch.float32 else y.to(dtype)


class Int8WeightOnlyGemm:
    """``y = x @ (q * scale).T (+ bias)``: int8 weight, float32 activations and math.

    Same call signature as :class:`~fleetserve.layers.cpu_gemm.PackedLinear`
    (``gemm(x, weight, bias)``; the ``weight`` argument is ignored). ``x``: ``[..., in]``
    any float dtype (computed in float32, cast back); returns ``[..., out]``.
    ``amax``: row maxima to use (see :func:`int8_row_absmax`).
    """

    __slots__ = ("q", "scale", "out_features", "in_features")

    def __init__(self, weight: torch.Tensor, amax: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        self.q, self.scale = quantize_int8_rows(weight, amax)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight ``[out, in]`` this linear multiplies by."""
        return self.q.float() * self.scale[:, None]

    def __call__(self, x: torch.Tensor, weight: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        dtype, shape = x.dtype, x.shape
        x2 = x.reshape(-1, shape[-1]).float()
        y = F.linear(x2, self.q.to(torch.float32)) * self.scale
        return _finish(y, shape, self.out_features, dtype, bias)


class Int4WeightOnlyGemm:
    """``y = x @ W4.T (+ bias)`` with ``W4`` 4-bit per group (see the module doc), float32 math.

    Packed with ``torch.ops.aten._convert_weight_to_int4pack_for_cpu``; multiplied with
    ``torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros)``
    where ``scales_and_zeros [in / g, out_padded, 2]`` float32 holds ``(scale, min + 8 * scale)``.
    Same call signature as :class:`Int8WeightOnlyGemm`.
    """

    __slots__ = ("packed", "scales_and_zeros", "group_size", "out_features", "in_features", "_q", "_scale", "_min")

    def __init__(self, weight: torch.Tensor, group_size: int) -> None:
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        self.group_size = int(group_size)
        q, scale, lo = quantize_int4_groups(weight, group_size)
        self._q, self._scale, self._min = q, scale, lo  # for dequantized() (the many-rows path): 1 byte / weight
        pad = -self.out_features % _INT4_ROW_MULTIPLE
        if pad:
            q = torch.cat([q, q.new_zeros(pad, q.shape[1])])
            scale = torch.cat([scale, scale.new_ones(pad, scale.shape[1])])
            lo = torch.cat([lo, lo.new_zeros(pad, lo.shape[1])])
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        self.scales_and_zeros = torch.stack([scale.T, (lo + 8.0 * scale).T], dim=-1).contiguous()

    def dequantized(self) -> torch.Tensor:
        """The float32 weight ``[out, in]`` (``q * scale + min`` per group)."""
        g = self.group_size
        q = self._q.float().reshape(self.out_features, -1, g)
        return (q * self._scale[..., None] + self._min[..., None]).reshape(self.out_features, self.in_features)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        dtype, shape = x.dtype, x.shape
        x2 = x.reshape(-1, shape[-1]).float().contiguous()
        if x2.shape[0] == 0:
            y = x2.new_zeros(0, self.out_features)
        elif x2.shape[0] >= INT4_DEQUANT_ROWS:
            y = F.linear(x2, self.dequantized())
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group_size, self.scales_and_zeros)
            if y.shape[-1] != self.out_features:
                y = y[:, : self.out_features]
        return _finish(y, shape, self.out_features, dtype, bias)
