"""Attention over the KV pool: the ragged attention kernel
and multi-head / grouped-query attention (Llama) over :class:`MHAKVPool`.

How a batch is attended without per-request Python loops: every request's KV
slots (``ForwardBatch.kv_indices``) are padded to the longest sequence into one
index matrix ``kv_idx [B, L]`` (padding points at the scratch slot 0), the
keys and values are gathered from the pool with one ``index_select``, and the
queries are laid out as ``[B, S, h, d]`` (``S`` = most new tokens of one
request; 1 for DECODE). A boolean mask ``[B, 1, S, L]`` allows key ``j`` for
the ``i``-th new token of request ``b`` iff ``j < seq_len[b]`` and
``j <= prefix_len[b] + i`` (causal, with the cached prefix fully visible).
Padded query rows see every real key of their request, so no softmax row is
empty; their outputs are dropped. Then one ``torch.nn.functional.
scaled_dot_product_attention`` call does the work (``enable_gqa`` for GQA/MQA).

When padding would waste too much (one long prompt next to many short ones),
:meth:`ForwardContext.build` splits the batch into a few groups of similar
lengths and :func:`attend` runs one such call per group.

Inside a compiled decode step (``--enable-torch-compile`` on CPU) a DECODE batch
can take :func:`decode_attention_reduction` instead (:data:`FUSED_DECODE_ATTENTION`, off by
default): the same attention written as
elementwise products and sums, which inductor turns into loops that read each
request's K/V rows from the pool through ``kv_idx`` (the gather is fused into the
score and output reductions, so no padded copy of K/V is written and read back).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fleetserve.core import fast_path
from fleetserve.core.forward_context import ForwardContext
from fleetserve.core.kv_pool import MHAKVPool
from fleetserve.layers.linear import ColumnParallelLinear, RowParallelLinear, TPGroup, UNSHARDED
from fleetserve.layers.rotary import RotaryEmbedding


def gather_rows(buffer: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
    """``buffer [P, *rest]`` rows at ``kv_idx [B, L]`` -> ``[B, L, *rest]`` (one index_select)."""
    B, L = kv_idx.shape
    return buffer.index_select(0, kv_idx.reshape(-1)).view(B, L, *buffer.shape[1:])


#: How ``scaled_dot_product_attention`` is dispatched on CUDA (:func:`configure_cuda_sdpa`;
#: env ``FLEETSERVE_CUDA_SDPA``): ``auto`` leaves torch's choice (cuDNN's kernel first on Hopper);
#: ``no_cudnn`` switches cuDNN's kernel off, so torch takes its memory-efficient or math kernel;
#: ``expand`` does that and also repeats K/V heads to the query heads (GQA / MLA), which the
#: memory-efficient kernel needs. Why: on an H200 (torch 2.11, cuDNN SDPA) every call with a new
#: KV length built a new cuDNN plan, about 1.2 ms of host time per layer per step -- most of an
#: eager decode step of SmolLM2-135M (benchmarks/cuda_check.py, docs/benchmarks.md engine-cuda-check).
CUDA_SDPA_MODES = ("auto", "no_cudnn", "expand")
_CUDA_SDPA = {"mode": "auto"}


def configure_cuda_sdpa(mode: str | None = None) -> str:
    """Set how attention runs on CUDA for this process; returns the mode set.

    Args:
        mode: one of :data:`CUDA_SDPA_MODES`; None = env ``FLEETSERVE_CUDA_SDPA``, else
            :data:`DEFAULT_CUDA_SDPA`.

    Raises:
        ValueError: an unknown mode (naming ``FLEETSERVE_CUDA_SDPA``).
    """
    import os

    mode = mode or os.environ.get("FLEETSERVE_CUDA_SDPA") or DEFAULT_CUDA_SDPA
    if mode not in CUDA_SDPA_MODES:
        raise ValueError(f"FLEETSERVE_CUDA_SDPA must be one of {CUDA_SDPA_MODES}, got {mode!r}")
    torch.backends.cuda.enable_cudnn_sdp(mode == "auto")
    _CUDA_SDPA["mode"] = mode
    return mode


def expand_kv_heads(x: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    """``[B, L, hk, d] -> [B, L, num_q_heads, d]``: KV head ``j`` repeated for the
    ``num_q_heads / hk`` query heads that read it (query head ``i`` reads KV head
    ``i // (num_q_heads / hk)``, the grouping of ``enable_gqa``)."""
    return x.repeat_interleave(num_q_heads // x.shape[2], dim=2)


#: The mode a CUDA model runner sets when neither the caller nor the environment names one.
DEFAULT_CUDA_SDPA = "no_cudnn"


#: Compiled DECODE steps on CPU use :func:`decode_attention_reduction` when True (read at trace time),
#: SDPA over a gathered copy of the KV otherwise.  On by default since it measured faster in
#: SmolLM2's whole compiled step at 32 requests, 2 threads, in every pair run (6 pairs on two EPYC
#: machines, 2026-12-04/05: float32 63-87 vs 65-110 ms, bf16_linear 41 vs 48-51 ms per step;
#: docs/benchmarks.md ``engine-c32-fused-attention``).  Its first form was slower (inductor
#: recomputed the queries' RoPE inside the score loop); the form below makes inductor write the
#: queries out first.  benchmarks/decode_step_profile.py ``--sdpa-attention`` is the A/B.
FUSED_DECODE_ATTENTION = True


def decode_attention_reduction(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                               scale: float) -> torch.Tensor:
    """Decode attention (one query per request) as plain reductions, for inductor to fuse.

    Args:
        q: ``[B, hq, dk]`` one query per request.
        k: ``[B, L, hk, dk]`` keys (usually a gather of the pool, left unmaterialised by
            inductor); ``hq % hk == 0``, query head ``i`` reads KV head ``i // (hq // hk)``
            (the grouping of SDPA's ``enable_gqa``).
        v: ``[B, L, hk, dv]`` values.
        mask: additive ``[B, 1, 1, L]`` (0 / -inf; every row has a 0), or None.
        scale: softmax scale.

    Returns ``[B, hq, dv]`` in ``q``'s dtype, computed in float32. In eager mode this is
    slower than SDPA (it materialises ``[B, L, hk, g, dk]`` products); it exists for the
    compiled step: one SmolLM2-shaped layer, 32 requests of 100-250 tokens, 2 threads, measured
    0.86 ms compiled against 1.6-1.9 ms for SDPA over the gathered K/V (hand-run micro-benchmark,
    2026-12-02; see :data:`FUSED_DECODE_ATTENTION` for the whole step).
    """
    B, L, hk, dk = k.shape
    hq = q.shape[1]
    g = hq // hk
    qf = q.float()
    if torch.compiler.is_compiling():
        # Make inductor write the queries out once. Left to itself it inlines their producer
        # (RoPE, the bf16 -> float32 cast) into the score loop and recomputes it for every key:
        # on SmolLM2 that made the compiled step slower than SDPA's. The prim is a no-op copy
        # in eager and, lowered, realises its input (torch/_inductor/inductor_prims.py).
        from torch._inductor import inductor_prims  # (registers prims.inductor_force_stride_order)
        qf = inductor_prims.force_stride_order(qf.contiguous(), (hq * dk, dk, 1))
    qf = qf.view(B, 1, hk, g, dk)
    s = (qf * k.float().unsqueeze(3)).sum(-1) * scale  # [B, L, hk, g]
    if mask is not None:
        s = s + mask.float().view(B, L, 1, 1)
    p = torch.softmax(s, dim=1)
    out = (p.unsqueeze(-1) * v.float().unsqueeze(3)).sum(1)  # [B, hk, g, dv]
    return out.reshape(B, hq, v.shape[-1]).to(q.dtype)


def ragged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: ForwardContext,
                     scale: float) -> torch.Tensor:
    """Attention of flat queries over each request's gathered keys/values.

    Args:
        q: ``[T, hq, dk]`` new tokens' queries (flat over the batch).
        k: ``[B, L, hk, dk]`` keys (``hq % hk == 0``; hk = 1 for MQA/MLA).
        v: ``[B, L, hk, dv]`` values.
        meta: the batch's :class:`ForwardContext`.
        scale: softmax scale.

    Returns ``[T, hq, dv]`` in ``q``'s dtype.
    """
    T, hq, dk = q.shape
    B, S = meta.batch_size, meta.max_q_len
    if T == 0:
        return q.new_zeros(0, hq, v.shape[-1])
    if meta.q_gather is None:
        if FUSED_DECODE_ATTENTION and torch.compiler.is_compiling() and q.device.type == "cpu":
            return decode_attention_reduction(q.view(B, hq, dk), k, v, meta.additive_mask(q.dtype), scale)
        qp = q.view(B, 1, hq, dk)
    else:
        qp = torch.cat([q, q.new_zeros(1, hq, dk)]).index_select(0, meta.q_gather).view(B, S, hq, dk)
    if k.shape[2] != hq and q.is_cuda and _CUDA_SDPA["mode"] == "expand":
        k, v = expand_kv_heads(k, hq), expand_kv_heads(v, hq)
    out = F.scaled_dot_product_attention(
        qp.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=meta.additive_mask(q.dtype),
        scale=scale, enable_gqa=k.shape[2] != hq,
    )  # [B, hq, S, dv]
    out = out.transpose(1, 2).reshape(B * S, hq, -1)
    if meta.q_scatter is not None:
        out = out.index_select(0, meta.q_scatter)
    return out


def attend(q: torch.Tensor, meta: ForwardContext, gather_kv, scale: float) -> torch.Tensor:
    """Run :func:`ragged_attention` over the whole batch, or group by group.

    Args:
        q: ``[T, hq, dk]`` flat queries.
        gather_kv: ``kv_idx [B_g, L_g] -> (k [B_g, L_g, hk, dk], v [B_g, L_g, hk, dv])``.

    Returns ``[T, hq, dv]``.
    """
    if meta.groups is None:
        k, v = gather_kv(meta.kv_idx)
        return ragged_attention(q, k, v, meta, scale)
    out = None
    for g in meta.groups:
        k, v = gather_kv(g.kv_idx)
        part = ragged_attention(q.index_select(0, g.token_idx), k, v, g, scale)
        if out is None:
            out = part.new_empty(q.shape[0], *part.shape[1:])
        out.index_copy_(0, g.token_idx, part)
    return out


class MHAttention(nn.Module):
    """Llama-style self-attention (MHA / GQA) with RoPE over :class:`MHAKVPool`.

    Query heads are split over ``tp`` (``num_heads / tp.size`` per rank); KV heads
    too when there are at least ``tp.size`` of them, otherwise each rank keeps
    the one KV head its query heads use (replicated KV).

    ``forward(hidden [T, H], meta, pool) -> [T, H]``: projects Q/K/V, applies
    RoPE at ``meta.positions``, writes K/V to ``meta.out_cache_loc`` of layer
    ``layer_id``, attends over each request's ``kv_indices`` and projects back.
    """

    def __init__(self, layer_id: int, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 rotary: RotaryEmbedding, tp: TPGroup = UNSHARDED, bias: bool = False, o_bias: bool = False,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        if num_heads % tp.size:
            raise ValueError(f"{num_heads} attention heads are not divisible by attention TP size {tp.size}")
        if num_kv_heads >= tp.size and num_kv_heads % tp.size:
            raise ValueError(f"{num_kv_heads} KV heads are not divisible by attention TP size {tp.size}")
        if num_kv_heads < tp.size and tp.size % num_kv_heads:
            raise ValueError(f"attention TP size {tp.size} is not a multiple of {num_kv_heads} KV heads")
        self.layer_id = layer_id
        self.head_dim = head_dim
        self.num_heads = num_heads // tp.size
        if num_kv_heads >= tp.size:
            self.num_kv_heads = num_kv_heads // tp.size
            kv_start = tp.rank * self.num_kv_heads
        else:
            self.num_kv_heads = 1
            kv_start = tp.rank * num_kv_heads // tp.size
        q_rows = (tp.rank * self.num_heads * head_dim, (tp.rank + 1) * self.num_heads * head_dim)
        kv_rows = (kv_start * head_dim, (kv_start + self.num_kv_heads) * head_dim)
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.qkv_proj = ColumnParallelLinear(
            hidden_size, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim],
            bias=bias, tp=tp, dtype=dtype, shard_rows=[q_rows, kv_rows, kv_rows])
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden_size, bias=o_bias, tp=tp, dtype=dtype)
        self.rotary = rotary
        self.scale = head_dim ** -0.5
        #: queries and keys rotated by one call (neox layout over the whole head)
        self._rotate_together = not rotary.interleaved and rotary.rotary_dim == head_dim

    def forward(self, hidden: torch.Tensor, meta: ForwardContext, pool: MHAKVPool) -> torch.Tensor:
        T = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        if fast_path.ENABLED and self._rotate_together:
            qk_size = self.q_size + self.kv_size
            qk = self.rotary.rotate_heads(
                meta.positions, qkv[:, :qk_size].view(T, self.num_heads + self.num_kv_heads, self.head_dim))
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads:]
            v = qkv[:, qk_size:].view(T, self.num_kv_heads, self.head_dim)
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.view(T, self.num_heads, self.head_dim)
            k = k.view(T, self.num_kv_heads, self.head_dim)
            v = v.view(T, self.num_kv_heads, self.head_dim)
            q, k = self.rotary(meta.positions, q, k)
        if T:
            pool.set_kv(self.layer_id, meta.out_cache_loc, k, v)
        kbuf, vbuf = pool.k_buffer[self.layer_id], pool.v_buffer[self.layer_id]
        if meta.kv_start is not None:  # one request on one ascending run of slots: a view, no gather
            s, L = meta.kv_start, meta.kv_idx.shape[1]
            kv = (kbuf.narrow(0, s, L).unsqueeze(0), vbuf.narrow(0, s, L).unsqueeze(0))
            out = ragged_attention(q, kv[0], kv[1], meta, self.scale)
        else:
            out = attend(q, meta, lambda idx: (gather_rows(kbuf, idx), gather_rows(vbuf, idx)), self.scale)
        return self.o_proj(out.reshape(T, self.q_size))
