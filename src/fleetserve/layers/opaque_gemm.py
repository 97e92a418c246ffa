"""The linears' gemms as one opaque custom op while ``torch.compile`` traces (``--enable-torch-compile``).

Eager, a linear layer calls its ``_gemm`` object: :class:`~fleetserve.layers.cpu_gemm.PackedLinear`
(oneDNN with a weight packed once) or a ``--quantization`` kernel (fbgemm int8 / fp16 weights,
weight-only int8 / int4). Traced as Python, those would become plain ``F.linear`` (inductor cannot
see the packed copy) or fail on the fbgemm packed-parameter objects. So :func:`linear_gemm`, while
compiling, emits ``fleetserve::gemm(x, weight, bias, handle)`` instead: one node inductor leaves
alone, whose body at run time calls the same ``_gemm`` of the same layer, so the compiled step uses
exactly the eager kernels (same tokens in float32) and inductor fuses only what lies between them
(norms, RoPE, activations, attention masks). ``handle`` is the layer's number in a process-wide
table of weak references, given by :func:`register_gemm_layers` before compiling.

An fp16-weight linear with the C++ op of :mod:`fleetserve.layers.fp16_gemm_ext` switched on
(``FLEETSERVE_FP16_GEMM_EXT=1``) emits ``fleetserve_fp16::gemm(x, ext_handle)`` instead (2-D float32
``x``, no bias): the same kernel, reached without a Python body. A ``bf16_linear`` layer (2-D ``x``)
emits ``fleetserve::gemm_bf16(x.to(bfloat16), handle).to(x.dtype)``: the kernel alone in the op, the
casts as graph nodes (the same values as eager: the same casts and the same kernel).

Output: ``[..., weight.shape[0]]`` in ``x``'s dtype (every ``_gemm`` returns that).
"""

from __future__ import annotations

import itertools
import weakref
from typing import Optional

import torch
from torch import nn

_LAYERS: "weakref.WeakValueDictionary[int, nn.Module]" = weakref.WeakValueDictionary()
_NEXT = itertools.count(1)


def register_gemm_layers(model: nn.Module) -> int:
    """Give every module of ``model`` that has a ``_gemm`` a handle (once); returns how many have one."""
    n = 0
    for m in model.modules():
        if hasattr(m, "_gemm"):
            if getattr(m, "_gemm_handle", None) is None:
                m._gemm_handle = next(_NEXT)
                _LAYERS[m._gemm_handle] = m
            n += 1
    return n


#: ``fleetserve::gemm`` is defined with the low-level ``torch.library.Library`` API rather than the
#: ``torch.library.custom_op`` decorator: the op is called once per linear per compiled step (121
#: times per SmolLM2 token), and the decorator's Python wrappers cost ~40 us a call against ~22 us
#: here (1 thread, process CPU time, a 1 x 64 x 64 linear; docs/benchmarks.md, engine-c1-compiled).
_LIB = torch.library.Library("fleetserve", "FRAGMENT")
_LIB.define("gemm(Tensor x, Tensor weight, Tensor? bias, int handle) -> Tensor")


def _gemm_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], handle: int) -> torch.Tensor:
    return _LAYERS[handle]._gemm(x, weight, bias)


_LIB.impl("gemm", _gemm_op, "CompositeExplicitAutograd")


@torch.library.register_fake("fleetserve::gemm", lib=_LIB)
def _(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], handle: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


#: ``fleetserve::gemm_bf16(xb, handle)``: the ``bf16_linear`` kernel alone on a 2-D bfloat16 input
#: (:meth:`fleetserve.layers.bf16_gemm.Bf16LinearGemm.bf16_2d`), so the casts to and from bfloat16 stay in
#: the graph, where inductor fuses them into the neighbouring kernels, and the op's Python body is one call.
_LIB.define("gemm_bf16(Tensor xb, int handle) -> Tensor")


def _gemm_bf16_op(xb: torch.Tensor, handle: int) -> torch.Tensor:
    return _LAYERS[handle]._gemm.bf16_2d(xb)


_LIB.impl("gemm_bf16", _gemm_bf16_op, "CompositeExplicitAutograd")


@torch.library.register_fake("fleetserve::gemm_bf16", lib=_LIB)
def _(xb: torch.Tensor, handle: int) -> torch.Tensor:
    return xb.new_empty((xb.shape[0], _LAYERS[handle]._gemm.out_features))


def linear_gemm(layer: nn.Module, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``layer._gemm(x, weight, bias)``; through ``fleetserve::gemm`` while compiling a registered layer."""
    handle = getattr(layer, "_gemm_handle", None)
    if handle is not None and torch.compiler.is_compiling():
        ext = getattr(getattr(layer, "_gemm", None), "_ext", None)
        if ext is not None and bias is None and x.dim() == 2 and x.dtype == torch.float32:
            return torch.ops.fleetserve_fp16.gemm(x, ext)  # C++ all the way (layers/fp16_gemm_ext.py)
        if hasattr(layer._gemm, "bf16_2d") and x.dim() == 2:  # bf16_linear: the casts stay in the graph
            y = torch.ops.fleetserve.gemm_bf16(x.to(torch.bfloat16).contiguous(), handle)
            return y.to(x.dtype) if bias is None else y.to(x.dtype) + bias.to(x.dtype)
        return torch.ops.fleetserve.gemm(x, weight, bias, handle)
    return layer._gemm(x, weight, bias)
