"""Attention over the KV pool: batch metadata, the ragged attention kernel,
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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fleetserve.engine.forward_batch import ForwardBatch, ForwardMode
from fleetserve.engine.kv_pool import MHAKVPool
from fleetserve.layers.linear import ColumnParallelLinear, RowParallelLinear, TPGroup, NO_TP
from fleetserve.layers.rotary import RotaryEmbedding


@dataclass
class AttentionMetadata:
    """Per-forward indexing shared by every layer (built once per batch).

    Attributes:
        mode: the batch's ForwardMode.
        positions: int64 ``[T]``.
        out_cache_loc: int64 ``[T]`` pool slots the new tokens' KV go to.
        kv_idx: int64 ``[B, L]`` pool slots of every request's tokens, padded with 0.
        mask: bool ``[B, 1, S, L]``, True where attention is allowed.
        q_gather: int64 ``[B * S]`` row of the flat ``[T + 1]`` queries for each
            padded query position (``T`` = an all-zero padding row); None when
            ``S == 1`` and ``B == T`` (DECODE), where the layout is the identity.
        q_scatter: int64 ``[T]`` padded position ``b * S + i`` of each flat token,
            or None (identity).
        last_token_idx: int64 ``[B]`` flat index of each request's last new token.
        global_num_tokens: DP attention only: every attention group's token count this
            step (``ForwardBatch.global_num_tokens``), for the FFN gather; else None.
    """

    mode: ForwardMode
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    kv_idx: torch.Tensor
    mask: torch.Tensor
    q_gather: torch.Tensor | None
    q_scatter: torch.Tensor | None
    last_token_idx: torch.Tensor
    batch_size: int
    max_q_len: int
    num_tokens: int

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """``mask`` as 0 / -inf in ``dtype`` (built once per forward, shared by all layers)."""
        cache = self.__dict__.setdefault("_additive", {})
        if dtype not in cache:
            m = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device)
            cache[dtype] = m.masked_fill_(~self.mask, float("-inf"))
        return cache[dtype]
    global_num_tokens: list[int] | None = None

    @classmethod
    def build(cls, batch: ForwardBatch, device: torch.device | str | None = None) -> "AttentionMetadata":
        """Index tensors for ``batch`` on ``device`` (default: where ``input_ids`` live)."""
        device = batch.input_ids.device if device is None else torch.device(device)
        B, T = batch.batch_size, batch.num_tokens
        ext = batch.extend_seq_lens.to(device)
        seq = batch.seq_lens.to(device)
        last = torch.cumsum(ext, 0) - 1 if B else torch.zeros(0, dtype=torch.int64, device=device)
        if B == 0:
            z = torch.zeros(0, 0, dtype=torch.int64, device=device)
            return cls(batch.mode, batch.positions.to(device), batch.out_cache_loc.to(device), z,
                       torch.zeros(0, 1, 1, 0, dtype=torch.bool, device=device), None, None, last, 0, 1, 0)
        kv_idx = torch.nn.utils.rnn.pad_sequence([k.to(device) for k in batch.kv_indices],
                                                 batch_first=True, padding_value=0)
        L = kv_idx.shape[1]
        keys = torch.arange(L, device=device)
        if batch.mode == ForwardMode.DECODE or T == B:
            S = 1
            mask = (keys[None, :] < seq[:, None]).view(B, 1, 1, L)
            q_gather = q_scatter = None
        else:
            S = int(ext.max())
            prefix = batch.extend_prefix_lens.to(device)
            qpos = torch.arange(S, device=device)
            limit = torch.minimum(prefix[:, None] + qpos[None, :] + 1, seq[:, None])  # [B, S]
            mask = (keys[None, None, :] < limit[:, :, None]).view(B, 1, S, L)
            starts = last - ext + 1  # flat index of each request's first new token
            flat = starts[:, None] + qpos[None, :]
            valid = qpos[None, :] < ext[:, None]
            q_gather = torch.where(valid, flat, torch.full_like(flat, T)).view(-1)
            q_scatter = (torch.arange(B, device=device)[:, None] * S + qpos[None, :])[valid]
        return cls(batch.mode, batch.positions.to(device), batch.out_cache_loc.to(device), kv_idx, mask,
                   q_gather, q_scatter,
                   last, B, S, T)


def gather_rows(buffer: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
    """``buffer [P, *rest]`` rows at ``kv_idx [B, L]`` -> ``[B, L, *rest]`` (one index_select)."""
    B, L = kv_idx.shape
    return buffer.index_select(0, kv_idx.reshape(-1)).view(B, L, *buffer.shape[1:])


def ragged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                     scale: float) -> torch.Tensor:
    """Attention of flat queries over each request's gathered keys/values.

    Args:
        q: ``[T, hq, dk]`` new tokens' queries (flat over the batch).
        k: ``[B, L, hk, dk]`` keys (``hq % hk == 0``; hk = 1 for MQA/MLA).
        v: ``[B, L, hk, dv]`` values.
        meta: the batch's :class:`AttentionMetadata`.
        scale: softmax scale.

    Returns ``[T, hq, dv]`` in ``q``'s dtype.
    """
    T, hq, dk = q.shape
    B, S = meta.batch_size, meta.max_q_len
    if T == 0:
        return q.new_zeros(0, hq, v.shape[-1])
    if meta.q_gather is None:
        qp = q.view(B, 1, hq, dk)
    else:
        qp = torch.cat([q, q.new_zeros(1, hq, dk)]).index_select(0, meta.q_gather).view(B, S, hq, dk)
    out = F.scaled_dot_product_attention(
        qp.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=meta.additive_mask(q.dtype),
        scale=scale, enable_gqa=k.shape[2] != hq,
    )  # [B, hq, S, dv]
    out = out.transpose(1, 2).reshape(B * S, hq, -1)
    if meta.q_scatter is not None:
        out = out.index_select(0, meta.q_scatter)
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
                 rotary: RotaryEmbedding, tp: TPGroup = NO_TP, bias: bool = False, o_bias: bool = False,
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

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata, pool: MHAKVPool) -> torch.Tensor:
        T = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(meta.positions, q, k)
        if T:
            pool.set_kv(self.layer_id, meta.out_cache_loc, k, v)
        keys = gather_rows(pool.k_buffer[self.layer_id], meta.kv_idx)
        values = gather_rows(pool.v_buffer[self.layer_id], meta.kv_idx)
        out = ragged_attention(q, keys, values, meta, self.scale)
        return self.o_proj(out.reshape(T, self.q_size))
