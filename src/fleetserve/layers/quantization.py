"""Quantized linears on CPU (``--quantization``), made once after the weights load.

Weight-only modes ``int8wo`` and ``int4wo-<32|64|128|256>`` (SGLang's ``--torchao-config``
names, aten kernels) live in :mod:`fleetserve.layers.weight_only`; this module resolves
the flag and swaps every target layer's gemm. The two fbgemm schemes (``torch.ops.quantized``):

* ``int8`` (alias ``w8a8_int8``, SGLang's name): W8A8 with dynamic activations.
  Each weight is quantized once to int8, symmetric, one scale per output row
  (``scale_o = max|W[o, :]| / 127``); at every call fbgemm quantizes the
  activations to uint8 with one scale and zero point for its whole input,
  multiplies in int8 with int32 accumulation and dequantizes to float32
  (``linear_prepack`` / ``linear_dynamic``, the op behind the deprecated
  ``torch.ao.nn.quantized.dynamic.Linear``, used here without that module API).
  Without VNNI, fbgemm adds pairs of uint8 x int8 products in int16
  (``vpmaddubsw``), which saturates for large activations, so activations are
  quantized to 7 bits there (``reduce_range=True``, as PyTorch's x86 default
  qconfig); with VNNI (``avx512_vnni`` / ``avx_vnni``) all 8 bits are used.
  Two things make it usable on SmolLM2 (docs/quantization.md): per-token activation
  scales (each row is divided by its own ``max|x_i|`` around the call, so the kernel's
  one scale fits every token: :class:`Int8DynamicGemm`) and SmoothQuant channel
  smoothing calibrated at load (:mod:`fleetserve.layers.smooth_quant`, folded into the
  RMSNorm weights and the up / V rows, so no run-time cost). Without them one token's
  huge down-projection input flattened every other token to a few levels.
* ``fp16_weight`` (this project's name; neither peer has it): weights stored
  as float16, activations and accumulation float32 (``linear_prepack_fp16`` /
  ``linear_dynamic_fp16``). Error ~2e-4 per linear; halves the weight reads.

And one oneDNN mode: ``bf16_linear`` (this project's name too): weights, inputs and outputs
of the linears in bfloat16 with float32 accumulation, everything else float32; fast where
the CPU has AMX (:mod:`fleetserve.layers.bf16_gemm`), ~3e-3 error per linear. Its LM head is
a :class:`~fleetserve.layers.rescored_head.RescoredHead`: the 16 largest bfloat16 logits of
each row are recomputed in float32, so near ties between top tokens are decided as float32
decides them (on SmolLM2 that alone raised greedy agreement with float32 from 56.5% to 91.7%:
docs/benchmarks.md, ``quant_quality-amx-head``).

Why these: ``benchmarks/quant_linear.py`` (docs/benchmarks.md, "Int8 linears
vs float32") measured fbgemm int8 2-5x faster than float32 at 32 rows on
SmolLM2's shapes on an AVX2-only EPYC, while weight-only int8
(``torch._weight_int8pack_mm``, torchao 0.18's ``Int8WeightOnlyConfig``), torchao's
eager ``Int8DynamicActivationInt8WeightConfig`` and ``torch._int_mm`` with per-token
scales were all slower than float32 there.

Under tensor parallelism every rank quantizes its own shard (the layers hold
only their shard), so quantized weights are sharded exactly like float32 ones.
What is quantized: :class:`~fleetserve.layers.linear.ColumnParallelLinear`,
:class:`~fleetserve.layers.linear.RowParallelLinear` and
:class:`~fleetserve.layers.linear.ParallelLMHead` (tied or not; the embedding
lookup keeps the float32 table). MoE experts, MLA's absorbed projections and the
embedding stay float32. The float32 weight is kept (the LM head may share it
with the embedding), so int8 adds ~25% and fp16 ~50% weight memory.
"""

from __future__ import annotations

import logging
import warnings
from typing import Callable, Sequence

import torch
from torch import nn

from fleetserve.core import fast_path
from fleetserve.core.cpu_features import has_amx_bf16, has_vnni
from fleetserve.layers import bf16_gemm, fp16_gemm_ext
from fleetserve.layers.fbgemm_calls import LINEAR_DYNAMIC_FP16, LINEAR_DYNAMIC_INT8
from fleetserve.layers.smooth_quant import ALPHA, restore_norms, smooth
from fleetserve.layers.weight_only import INT4_GROUP_SIZES, Int4WeightOnlyGemm, Int8WeightOnlyGemm, int8_row_absmax

logger = logging.getLogger(__name__)

#: Values of ``--quantization``. ``w8a8_int8`` is SGLang's name for the same
#: W8A8 int8 scheme and is accepted as an alias of ``int8``. ``fp16_weight`` is
#: this project's own (neither peer has it): weights stored in float16, math in float32.
#: ``int8wo`` / ``int4wo-<g>``: weight-only int8 / int4 (SGLang's ``--torchao-config``
#: spellings; :mod:`fleetserve.layers.weight_only`).
WEIGHT_ONLY_CHOICES = ("int8wo",) + tuple(f"int4wo-{g}" for g in INT4_GROUP_SIZES)
#: ``bf16_linear``: this project's too: weights and linear inputs in bfloat16, float32 accumulation and
#: output, everything else float32 (oneDNN; fast where the CPU has AMX: :mod:`fleetserve.layers.bf16_gemm`).
QUANTIZATION_CHOICES = ("none", "int8", "w8a8_int8", "fp16_weight", "bf16_linear") + WEIGHT_ONLY_CHOICES + ("auto",)
#: Modes that need fbgemm (x86 CPU).
FBGEMM_MODES = ("int8", "w8a8_int8", "fp16_weight")
#: Modes with CPU-only kernels.
CPU_MODES = FBGEMM_MODES + ("bf16_linear",) + WEIGHT_ONLY_CHOICES


def check_quantization(value: str | None, device: str = "cpu") -> None:
    """Raise ``ValueError`` (one line naming ``--quantization``) for a bad value or device."""
    if value is None:
        return
    if value not in QUANTIZATION_CHOICES:
        raise ValueError(f"--quantization must be one of {QUANTIZATION_CHOICES}, got {value!r}")
    if value in CPU_MODES and not str(device).startswith("cpu"):
        raise ValueError(f"--quantization {value} runs on CPU only (CPU kernels); "
                         f"use --quantization none or auto on {device}")


def fbgemm_available() -> bool:
    """Whether torch has fbgemm's int8 / fp16 kernels here (x86 with AVX2 or better)."""
    engines = torch.backends.quantized.supported_engines
    cap = torch.backends.cpu.get_cpu_capability()
    return ("fbgemm" in engines or "x86" in engines) and cap in ("AVX2", "AVX512")


def resolve_quantization(value: str | None, device: str | torch.device = "cpu") -> str:
    """The mode (``"int8"``, ``"fp16_weight"``, ``"int8wo"``, ``"int4wo-<g>"`` or ``"none"``) for ``value`` on ``device``.

    ``auto``: ``fp16_weight`` on a CPU where fbgemm runs (AVX2 or AVX-512), else
    ``none`` (CUDA, other CPUs). Not int8: on SmolLM2-135M, int8 W8A8 greedy
    continuations left float32's within the first few tokens (docs/benchmarks.md),
    while fp16 weights kept every token and were faster than float32 too.
    A CPU mode where fbgemm does not run raises ``ValueError``.
    """
    check_quantization(value, str(device))
    dev = torch.device(device)
    if value in (None, "none"):
        return "none"
    if value == "auto":
        return "fp16_weight" if dev.type == "cpu" and fbgemm_available() else "none"
    if value in WEIGHT_ONLY_CHOICES:
        return value
    if value == "bf16_linear":
        if not bf16_gemm.available():
            raise ValueError("--quantization bf16_linear: this torch build has no oneDNN packed linear "
                             "(torch.ops.mkldnn._linear_pointwise); use --quantization none")
        return value
    if not fbgemm_available():
        raise ValueError(f"--quantization {value}: this CPU/torch build has no fbgemm kernels "
                         f"(capability {torch.backends.cpu.get_cpu_capability()}); use --quantization none")
    return "fp16_weight" if value == "fp16_weight" else "int8"


def quantize_weight_per_row(weight: torch.Tensor) -> torch.Tensor:
    """Symmetric per-output-row int8 quantization of ``weight [out, in]`` float32.

    Returns a per-channel ``torch.qint8`` tensor (axis 0) with scales
    ``max|W[o, :]| / 127`` (rows of zeros get scale 1) and zero points 0.
    """
    w = weight.detach().float().contiguous()
    amax = w.abs().amax(dim=1)
    scales = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax)).double()
    zero_points = torch.zeros(w.shape[0], dtype=torch.int64)
    with warnings.catch_warnings():  # quantized tensor creation is deprecated (the packed weight is what we keep)
        warnings.simplefilter("ignore", UserWarning)
        return torch.quantize_per_channel(w, scales, zero_points, 0, torch.qint8)


def activation_grid(reduce_range: bool) -> tuple[float, int]:
    """(scale, zero point) fbgemm's dynamic quantizer picks for an input spanning ``[-1, 1]``.

    The same ``ChooseQuantizationParams`` rule ``linear_dynamic`` applies to its input (via
    ``torch.quantize_per_tensor_dynamic``): uint8, 0..127 with ``reduce_range`` else 0..255.
    """
    with warnings.catch_warnings():  # quantized tensors are deprecated; only the two numbers are kept
        warnings.simplefilter("ignore", UserWarning)
        q = torch.quantize_per_tensor_dynamic(torch.tensor([-1.0, 1.0]), torch.quint8, bool(reduce_range))
    return float(q.q_scale()), int(q.q_zero_point())


class Int8DynamicGemm:
    """``y = x @ W.T (+ bias)`` through fbgemm's dynamic int8 linear, for one weight.

    Same call signature as :class:`~fleetserve.layers.cpu_gemm.PackedLinear`
    (``gemm(x, weight, bias)``) so a layer can swap it in; the ``weight``
    argument is ignored -- the int8 copy packed at construction is used.
    ``x``: ``[..., in]`` (any float dtype; computed in float32 and cast back);
    returns ``[..., out]``.

    ``per_token`` (default True): one activation scale per row (token) instead of one per
    call. fbgemm's kernel takes a single scale for the whole input, so each row is divided
    by its own ``max|x_i|`` before the call and its output row multiplied by it after
    (``y_i = r_i * ((x_i / r_i) W^T)``, exact in real arithmetic): every row then spans the
    full 7 / 8-bit range, and one token with huge activations (SmolLM2's first tokens reach
    ~100x the median in the down projection's input) no longer flattens the others to a few
    levels. Costs one row maximum, one ``[N, in]`` division and one ``[N, out]`` product.

    ``act_passes=2`` (with ``per_token``; what ``--quantization int8`` uses): the activation
    rounding error is quantized too, so activations carry ~14 bits instead of 7 and the
    weight's 8 bits are what is left. Each scaled row ``u = x_i / r_i`` is rounded here to
    fbgemm's own grid (:func:`activation_grid`), ``q = round(u / s) s``; the remainder
    ``e = u - q`` is scaled by its own row maximum ``r2`` to span the grid too; and one
    fbgemm call multiplies the stacked ``[q; e / r2; range row]`` (``2N + 1`` rows: the last
    row holds the grid's two ends, so fbgemm picks exactly that grid and re-quantizes ``q``
    without loss): ``y_i = r_i (q W^T + r2 (e / r2) W^T)``. The error left is ``e``'s own
    rounding (``s r2 / 2`` per element, ``r2 <= s / 2``): ~1/128 of one pass's. Costs the
    rows twice over in one call (the weight is read once) and a few ``[N, in]`` element-wise
    ops. This is residual (two-term) quantization: this project's arrangement for issue 16,
    not a published recipe; measured in ``benchmarks/int8_sensitivity.py``.


    ``weight_passes=2`` (with ``act_passes=2``): the weight's rounding error is a second int8
    matrix, ``W = W1 + W2`` (``W2`` = the per-row int8 of ``W - W1``), packed as extra output
    rows ``[W1; W2]``, and ``y = q W1^T + q W2^T + e W1^T`` (the ``e W2^T`` block, ~2^-14 of
    ``y``, is computed and dropped): ~15-bit weights, twice the weight bytes (fp16's) and
    twice the output columns.
    """

    __slots__ = ("_packed", "_reduce_range", "_per_token", "_passes", "_wpasses", "_grid", "out_features",
                 "in_features")

    def __init__(self, weight: torch.Tensor, reduce_range: bool | None = None, per_token: bool = True,
                 act_passes: int = 1, weight_passes: int = 1) -> None:
        if reduce_range is None:
            reduce_range = not has_vnni()
        if act_passes not in (1, 2) or weight_passes not in (1, 2):
            raise ValueError(f"act_passes and weight_passes must be 1 or 2, got {act_passes!r}, {weight_passes!r}")
        if weight_passes == 2 and (act_passes != 2 or not per_token):
            raise ValueError("weight_passes=2 needs act_passes=2 and per_token")
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        self._reduce_range = bool(reduce_range)
        self._per_token = bool(per_token)
        self._passes = int(act_passes) if per_token else 1
        self._wpasses = int(weight_passes)
        w = weight.detach().float()
        if weight_passes == 2:
            w1 = quantize_weight_per_row(w).dequantize()
            w = torch.cat([w1, w - w1])  # requantized per row: the W1 rows give back their own codes
        self._packed = torch.ops.quantized.linear_prepack(quantize_weight_per_row(w), None)
        self._grid = None
        if self._passes == 2:
            scale, zp = activation_grid(self._reduce_range)
            qmax = 127 if self._reduce_range else 255
            lo, hi = -zp * scale, (qmax - zp) * scale
            ends = torch.zeros(1, self.in_features)
            ends[0, 0], ends[0, -1] = lo, hi
            self._grid = (scale, float(-zp), float(qmax - zp), min(-lo, hi), ends)

    def _two_pass(self, x2: torch.Tensor) -> torch.Tensor:
        scale, kmin, kmax, half, ends = self._grid
        n = x2.shape[0]
        r = x2.abs().amax(dim=1, keepdim=True).clamp_(min=1e-30).div_(half)
        u = x2 / r  # rows in [-half, half], inside the grid
        q = (u / scale).round_().clamp_(kmin, kmax).mul_(scale)
        e = u.sub_(q)
        r2 = e.abs().amax(dim=1, keepdim=True).clamp_(min=1e-30).div_(half)
        stacked = torch.cat([q, e.div_(r2), ends])
        y = torch.ops.quantized.linear_dynamic(stacked, self._packed, self._reduce_range)
        if self._wpasses == 2:
            o = self.out_features
            return y[n:2 * n, :o].mul(r2).add_(y[:n, :o]).add_(y[:n, o:]).mul_(r)
        return y[n:2 * n].mul_(r2).add_(y[:n]).mul_(r)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        dtype = x.dtype
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.dtype != torch.float32:
            x2 = x2.float()
        if x2.shape[0] == 0:
            y = x2.new_zeros(0, self.out_features)
        elif self._passes == 2:
            y = self._two_pass(x2)
        elif self._per_token:
            r = x2.abs().amax(dim=1, keepdim=True).clamp_(min=1e-12)
            y = LINEAR_DYNAMIC_INT8((x2 / r).contiguous(), self._packed, self._reduce_range)
            y.mul_(r)
        else:
            y = LINEAR_DYNAMIC_INT8(x2.contiguous(), self._packed, self._reduce_range)
        if bias is not None:
            y = y + bias.float()
        y = y.reshape(*shape[:-1], self.out_features)
        return y if dtype == torch.float32 else y.to(dtype)


class Fp16WeightGemm:
    """``y = x @ W.T (+ bias)`` with ``W`` stored as float16, through fbgemm's fp16 GEMM.

    fbgemm converts the fp16 weight blocks to float32 in registers (F16C) and
    accumulates in float32, so only the weight's rounding to fp16 (relative
    error ~2e-4 per linear) differs from float32; the weight reads are halved.
    Kernel pair: ``torch.ops.quantized.linear_prepack_fp16`` /
    ``torch.ops.quantized.linear_dynamic_fp16`` (called through its resolved overload,
    :mod:`fleetserve.layers.fbgemm_calls`). Same call signature as
    :class:`Int8DynamicGemm` (the ``weight`` argument is ignored). With
    ``FLEETSERVE_FP16_GEMM_EXT=1`` the same kernel is reached through the C++ op of
    :mod:`fleetserve.layers.fp16_gemm_ext` (``_ext``: its handle, else None).
    """

    __slots__ = ("_packed", "out_features", "in_features", "_ext")

    def __init__(self, weight: torch.Tensor) -> None:
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        self._packed = torch.ops.quantized.linear_prepack_fp16(weight.detach().float().contiguous(), None)
        self._ext = fp16_gemm_ext.register(self._packed, self.out_features) if fp16_gemm_ext.enabled() else None

    def __call__(self, x: torch.Tensor, weight: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        if (bias is None and fast_path.ENABLED and x.dim() == 2 and x.dtype == torch.float32 and x.shape[0]
                and x.is_contiguous()):
            if self._ext is not None:
                return fp16_gemm_ext.gemm(x, self._ext)
            return LINEAR_DYNAMIC_FP16(x, self._packed)  # the common case, no reshapes
        dtype, shape = x.dtype, x.shape
        x2 = x.reshape(-1, shape[-1]).float()
        if x2.shape[0] == 0:
            y = x2.new_zeros(0, self.out_features)
        else:
            y = LINEAR_DYNAMIC_FP16(x2.contiguous(), self._packed)
        if bias is not None:
            y = y + bias.float()
        y = y.reshape(*shape[:-1], self.out_features)
        return y if dtype == torch.float32 else y.to(dtype)


def _targets(model: nn.Module) -> list[nn.Module]:
    from fleetserve.layers.linear import ColumnParallelLinear, ParallelLMHead, RowParallelLinear

    return [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear, ParallelLMHead))]


def apply_quantization(model: nn.Module, value: str | None, device: str | torch.device = "cpu",
                       calibrate: Callable[[Sequence[nn.Module]], dict] | None = None,
                       smoothing: bool = True, per_token: bool = True, act_passes: int = 1,
                       weight_passes: int = 1) -> str:
    """Quantize ``model``'s linears in place per ``--quantization value``; returns the mode used.

    Call after the weights are loaded (again with another mode if need be: every mode is made
    from the float32 weights the layers keep, and the RMSNorm weights an earlier ``int8``
    smoothed are put back first). Each targeted layer's ``_gemm`` becomes an
    :class:`Int8DynamicGemm`, :class:`Fp16WeightGemm` or weight-only gemm of its (shard of the)
    weight. Logs the choice.

    ``int8``: with ``calibrate`` (``calibrate(linears) -> {linear: max|x_j| float32 [in]}``,
    :func:`fleetserve.engine.int8_calibration.calibrator`) and a model that lists its
    ``int8_smoothing_groups()``, the linears are SmoothQuant-smoothed first
    (:mod:`fleetserve.layers.smooth_quant`); ``smoothing=False`` (benchmarks) skips that and
    gives the plain W8A8 of every linear; ``per_token=False`` (benchmarks) one activation scale
    per call instead of per token (:class:`Int8DynamicGemm`). Both off = the int8 of before.
    ``act_passes`` / ``weight_passes`` (benchmarks; 1 = ``--quantization int8``): residual
    (two-term) int8 activations / weights, :class:`Int8DynamicGemm`.

    Raises:
        ValueError: bad value, or int8 asked for where it cannot run (names ``--quantization``).
    """
    mode = resolve_quantization(value, device)
    restore_norms(model)
    if value == "auto":
        logger.info("--quantization auto -> %s on %s (CPU capability %s): fp16_weight was the fastest mode "
                    "that kept float32's quality in docs/benchmarks.md (measured on AVX2 only; there the "
                    "weight-only int kernels were slower than float32)", mode, device, torch.backends.cpu.get_cpu_capability())
    if mode == "none":
        if value == "auto":
            logger.info("--quantization auto: float32 linears (no fbgemm int8 kernels on %s)", device)
        return "none"
    layers = _targets(model)
    if mode in WEIGHT_ONLY_CHOICES:
        return _apply_weight_only(layers, value, mode)
    if mode == "bf16_linear":
        from fleetserve.layers.linear import ParallelLMHead
        from fleetserve.layers.rescored_head import TOP_K, RescoredHead

        for m in layers:
            m._gemm = bf16_gemm.Bf16LinearGemm(m.weight)
            if isinstance(m, ParallelLMHead):  # top logits in float32: greedy agreement 56.5% -> 91.7%
                m._gemm = RescoredHead(m.weight, m._gemm)
        logger.info("--quantization %s: %d linears in bfloat16 (oneDNN packed, float32 accumulation; AMX %s), "
                    "the LM head's top %d logits per row recomputed in float32", value, len(layers),
                    "yes" if has_amx_bf16() else "no: slow on this CPU", TOP_K)
        return mode
    if mode == "fp16_weight":
        for m in layers:
            m._gemm = Fp16WeightGemm(m.weight)
        logger.info("--quantization %s: %d linears with fp16 weights (fbgemm, float32 math; CPU capability %s)",
                    value, len(layers), torch.backends.cpu.get_cpu_capability())
        return mode
    reduce_range = not has_vnni()
    eff: dict = {}
    how = "no SmoothQuant (not asked for)" if not smoothing else "no SmoothQuant (no calibration pass given)"
    groups_of = getattr(model, "int8_smoothing_groups", None)
    if smoothing and calibrate is not None and groups_of is None:
        how = "no SmoothQuant (this model lists no smoothing groups)"
    if smoothing and calibrate is not None and groups_of is not None:
        from fleetserve.layers.cpu_gemm import PackedLinear

        for m in layers:  # calibrate on float32 linears
            m._gemm = PackedLinear()
        groups = groups_of()
        eff = smooth(groups, calibrate(layers), ALPHA)
        how = (f"SmoothQuant alpha {ALPHA} on {len(eff)} of them ({len(groups)} groups, s folded into "
               "the RMSNorm weights and the up / V rows; calibrated on a built-in text)")
    for m in layers:
        m._gemm = Int8DynamicGemm(eff.get(m, m.weight), reduce_range=reduce_range, per_token=per_token,
                                  act_passes=act_passes, weight_passes=weight_passes)
    logger.info("--quantization %s: %d linears int8 (fbgemm dynamic W8A8, per-row weight scales, "
                "%d-bit activations with one scale per %s: VNNI %s; CPU capability %s); %s", value, len(layers),
                7 if reduce_range else 8, "token" if per_token else "call", "no" if reduce_range else "yes",
                torch.backends.cpu.get_cpu_capability(), how)
    return "int8"


def _apply_weight_only(layers: list[nn.Module], value: str | None, mode: str) -> str:
    from fleetserve.layers.linear import ParallelLMHead, RowParallelLinear

    n = 0
    if mode == "int8wo":
        for m in layers:  # same order on every rank, so the MAX all-reduces pair up
            amax = None
            if isinstance(m, RowParallelLinear) and m.tp.size > 1:
                amax = int8_row_absmax(m.weight, m.tp.group, m.tp.size)  # the whole row's scale on every shard
            m._gemm = Int8WeightOnlyGemm(m.weight, amax)
            n += 1
    else:
        group = int(mode.split("-")[1])
        for m in layers:
            if isinstance(m, ParallelLMHead):
                continue  # stays float32 (the shipped GGUF's tied table is Q8_0: 4 bits would lose it)
            m._gemm = Int4WeightOnlyGemm(m.weight, group)
            n += 1
    logger.info("--quantization %s: %d linears weight-only %s (float32 activations; LM head %s)", value, n,
                "int8, per-row scales" if mode == "int8wo" else f"int4, groups of {mode.split('-')[1]}",
                "int8" if mode == "int8wo" else "float32")
    return mode
