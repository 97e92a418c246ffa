"""SmoothQuant smoothing for the int8 W8A8 linears (``--quantization int8``).

Xiao et al. 2023, "SmoothQuant" (arXiv 2211.10438), eq. 4: for a linear ``y = x W^T`` whose
input has a few channels much larger than the rest (SmolLM2's residual stream does),
pick per input channel ``j``

    ``s_j = max|X_j| ** alpha / max|W_{:, j}| ** (1 - alpha)``,  ``alpha = 0.5``

and compute ``y = (x / s) (W * s)^T``: the same product, but the activation outliers move
into the weight, where per-row int8 scales absorb them, so one activation scale per call
no longer wastes its 7 bits on a handful of channels. ``max|X_j|`` comes from a
calibration forward pass on a fixed text at load time (``fleetserve.engine.int8_calibration``).

``x / s`` costs nothing at run time: it is folded into whatever produces ``x``
(the paper's section 4.3):

* :class:`NormGroup` -- an RMSNorm feeds the linears (QKV after ``input_layernorm``, gate/up
  after ``post_attention_layernorm``, the LM head after the final norm): the norm's weight
  is divided by ``s`` (the norm is ``w * x / rms(x)``, so the output divides by ``s``).
* :class:`RowsGroup` -- rows of another linear produce the input: the down projection's
  input is ``silu(gate) * up``, so dividing up_proj's row ``j`` by ``s_j`` divides channel
  ``j``; the attention output projection's input is ``softmax(q k^T) v``, so dividing V's
  row (kv head ``h``, dim ``d``) by ``s`` divides that channel of every query head reading
  kv head ``h`` (with GQA the query heads that share a kv head share their ``s``: the
  maximum over them is taken). Those rows belong to a linear quantized per output row,
  so the division changes only that row's scale, not its int8 codes.

Only the quantized copies of the weights change (``W * s`` and the divided rows); every
layer keeps its float32 ``weight``. The RMSNorm weights are the one shared state changed:
:func:`restore_norms` puts the float32 ones back (before another mode is applied).

Tensor parallelism: a norm group's input is replicated on every rank of its group, and
each rank holds only some of the consumers' rows, so both maxima are MAX-all-reduced over
the group and every rank gets the same ``s`` and folds the same norm weight. A rows group
lives on one rank: the down projection's local input channels are the local up rows,
and the local query heads read the local kv heads, so its ``s`` needs no communication.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import nn

#: SmoothQuant's migration strength (the paper's default and its value for OPT / Llama-style models).
ALPHA = 0.5
#: Floor on both maxima (a channel never seen, or a column of zeros, gets a finite s).
EPS = 1e-5


def smoothing_factors(act_absmax: torch.Tensor, weight_absmax: torch.Tensor, alpha: float = ALPHA) -> torch.Tensor:
    """``s = act_absmax**alpha / weight_absmax**(1 - alpha)``, float32 ``[in]`` (eq. 4 of arXiv 2211.10438).

    Both inputs ``[in]`` float, the per-input-channel maxima of ``|X|`` and ``|W|``. Channels whose
    activation or weight maximum is 0 get ``s = 1`` (nothing to migrate).
    """
    a = act_absmax.detach().float()
    w = weight_absmax.detach().float()
    s = a.clamp(min=EPS).pow(alpha) / w.clamp(min=EPS).pow(1.0 - alpha)
    return torch.where((a > 0) & (w > 0), s, torch.ones_like(s))


@dataclass
class NormGroup:
    """Linears ``consumers`` all reading ``norm``'s output; ``tp_group`` / ``tp_size`` their sharding group."""

    norm: nn.Module
    consumers: Sequence[nn.Module]
    tp_group: Any = None
    tp_size: int = 1


@dataclass
class RowsGroup:
    """``consumer``'s input channel ``j`` is produced by row ``rows[j]`` of ``producer``'s output.

    ``rows``: int64 ``[n_rows]`` producer rows; ``channel_of_row``: int64 ``[n_rows]`` the smoothing
    index of each (several consumer channels may share one producer row: GQA); ``channels``:
    int64 ``[consumer in]`` each consumer input channel's smoothing index.
    """

    producer: nn.Module
    consumer: nn.Module
    rows: torch.Tensor
    channel_of_row: torch.Tensor
    channels: torch.Tensor
    n: int = field(default=0)


def gated_mlp_group(mlp: nn.Module) -> RowsGroup:
    """Down projection <- up rows of the fused gate/up linear (``[gate; up]``, ``local_inter`` each)."""
    n = mlp.local_inter
    idx = torch.arange(n)
    return RowsGroup(mlp.gate_up_proj, mlp.down_proj, rows=idx + n, channel_of_row=idx, channels=idx, n=n)


def attention_v_group(attn: nn.Module) -> RowsGroup:
    """O projection <- V rows of the fused QKV linear; query head ``i`` reads kv head ``i // (heads / kv heads)``."""
    hd, nh, nkv = attn.head_dim, attn.num_heads, attn.num_kv_heads
    per = nh // nkv
    d = torch.arange(hd)
    channels = torch.cat([(i // per) * hd + d for i in range(nh)])  # o_proj input channel -> (kv head, dim)
    rows = attn.q_size + attn.kv_size + torch.arange(nkv * hd)  # V rows in [q; k; v]
    return RowsGroup(attn.qkv_proj, attn.o_proj, rows=rows, channel_of_row=torch.arange(nkv * hd),
                     channels=channels, n=nkv * hd)


def _all_reduce_max(t: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    if size > 1:
        import torch.distributed as dist

        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t


def restore_norms(model: nn.Module) -> int:
    """Put back the float32 weight of every RMSNorm a previous :func:`smooth` divided; returns how many."""
    n = 0
    for m in model.modules():
        orig = getattr(m, "_fs_unsmoothed_weight", None)
        if orig is not None:
            with torch.no_grad():
                m.weight.copy_(orig)
            del m._fs_unsmoothed_weight
            n += 1
    return n


def smooth(groups: Sequence[NormGroup | RowsGroup], act_absmax: dict[nn.Module, torch.Tensor],
           alpha: float = ALPHA) -> dict[nn.Module, torch.Tensor]:
    """Apply SmoothQuant to ``groups``; returns ``{linear: smoothed float32 weight to quantize}``.

    ``act_absmax``: per consumer linear, ``max|x_j|`` over the calibration tokens, float32 ``[local in]``.
    Norm groups fold ``1 / s`` into the norm's weight (in place; the original is kept for
    :func:`restore_norms`); rows groups divide the producer's rows of its smoothed copy. Norm
    groups run collectives (MAX all-reduce) in group order: call on every rank with the same groups.
    A group whose consumer has no statistics is skipped.
    """
    eff: dict[nn.Module, torch.Tensor] = {}

    def weight_of(m: nn.Module) -> torch.Tensor:
        if m not in eff:
            eff[m] = m.weight.detach().float().clone()
        return eff[m]

    for g in groups:
        if isinstance(g, NormGroup):
            if any(c not in act_absmax for c in g.consumers):
                continue
            a = torch.stack([act_absmax[c].float() for c in g.consumers]).amax(0)
            w = torch.cat([c.weight.detach().float().abs() for c in g.consumers]).amax(0)
            both = _all_reduce_max(torch.stack([a, w]).contiguous(), g.tp_group, g.tp_size)
            s = smoothing_factors(both[0], both[1], alpha)
            for c in g.consumers:
                weight_of(c).mul_(s)
            norm = g.norm
            if getattr(norm, "_fs_unsmoothed_weight", None) is None:
                norm._fs_unsmoothed_weight = norm.weight.detach().clone()
            with torch.no_grad():
                norm.weight.copy_((norm._fs_unsmoothed_weight.float() / s).to(norm.weight.dtype))
        else:
            if g.consumer not in act_absmax:
                continue
            a_ch = act_absmax[g.consumer].float()
            w_ch = g.consumer.weight.detach().float().abs().amax(0)
            a = torch.zeros(g.n).scatter_reduce_(0, g.channels, a_ch, "amax")
            w = torch.zeros(g.n).scatter_reduce_(0, g.channels, w_ch, "amax")
            s = smoothing_factors(a, w, alpha)
            weight_of(g.consumer).mul_(s[g.channels])
            weight_of(g.producer)[g.rows] /= s[g.channel_of_row][:, None]
    return eff
