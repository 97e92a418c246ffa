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

When padding would waste too much (one long prompt next to many short ones),
:meth:`AttentionMetadata.build` splits the batch into a few groups of similar
lengths and :func:`attend` runs one such call per group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fleetserve.core.forward_batch import ForwardBatch, ForwardMode
from fleetserve.core.kv_pool import MHAKVPool
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
    global_num_tokens: list[int] | None = None
    #: Sub-batches, when padding the whole batch to one shape would waste too
    #: much (see :meth:`build`); None = one padded group (the common case).
    groups: list["AttentionMetadata"] | None = None
    #: For a sub-batch: int64 ``[T_g]`` rows of the full batch's flat tokens it holds.
    token_idx: torch.Tensor | None = None

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """``mask`` as 0 / -inf in ``dtype`` (built once per forward, shared by all layers)."""
        cache = self.__dict__.setdefault("_additive", {})
        if dtype not in cache:
            m = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device)
            cache[dtype] = m.masked_fill_(~self.mask, float("-inf"))
        return cache[dtype]

    @classmethod
    def build(cls, batch: ForwardBatch, device: torch.device | str | None = None) -> "AttentionMetadata":
        """Index tensors for ``batch`` on ``device`` (default: where ``input_ids`` live).

        One padded group costs ``B * S * L`` score entries (and gathers ``B * L``
        KV rows). When that exceeds twice the useful work ``sum(ext_i * seq_i)``
        (plus a small allowance) -- e.g. one long prompt batched with many short
        requests -- the requests are sorted by length and split greedily into
        groups that each stay within that bound; each layer then runs one SDPA
        call per group.
        """
        device = batch.input_ids.device if device is None else torch.device(device)
        B, T = batch.batch_size, batch.num_tokens
        positions, out_cache_loc = batch.positions.to(device), batch.out_cache_loc.to(device)
        ext = batch.extend_seq_lens.to(device)
        last = torch.cumsum(ext, 0) - 1 if B else torch.zeros(0, dtype=torch.int64, device=device)
        if B == 0:
            z = torch.zeros(0, 0, dtype=torch.int64, device=device)
            return cls(batch.mode, positions, out_cache_loc, z,
                       torch.zeros(0, 1, 1, 0, dtype=torch.bool, device=device), None, None, last, 0, 1, 0)
        seq_l = batch.seq_lens.tolist()
        ext_l = batch.extend_seq_lens.tolist()
        pre_l = batch.extend_prefix_lens.tolist()
        decode = batch.mode == ForwardMode.DECODE or T == B
        kv = [k.to(device) for k in batch.kv_indices]
        groups = _group_requests(seq_l, ext_l, decode)
        if len(groups) == 1:
            meta = _dense(batch.mode, kv, seq_l, ext_l, pre_l, decode, device)
            meta.positions, meta.out_cache_loc, meta.last_token_idx = positions, out_cache_loc, last
            return meta
        starts = [0]
        for e in ext_l[:-1]:
            starts.append(starts[-1] + e)
        subs = []
        for members in groups:
            sub = _dense(batch.mode, [kv[i] for i in members], [seq_l[i] for i in members],
                         [ext_l[i] for i in members], [pre_l[i] for i in members], decode, device)
            rows = [torch.arange(starts[i], starts[i] + ext_l[i]) for i in members]
            sub.token_idx = torch.cat(rows).to(device)
            subs.append(sub)
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        return cls(batch.mode, positions, out_cache_loc, empty.view(0, 0), torch.zeros(0, 1, 1, 0, dtype=torch.bool),
                   None, None, last, B, max(s.max_q_len for s in subs), T, groups=subs)


#: Padding allowance (score entries) below which a batch is never split.
_PAD_SLACK = 1 << 16


def _group_requests(seq: list[int], ext: list[int], decode: bool) -> list[list[int]]:
    """Split request indices into groups whose padded attention cost stays
    within ``2 * useful + _PAD_SLACK`` (see :meth:`AttentionMetadata.build`)."""
    q = [1] * len(seq) if decode else ext
    useful = sum(a * b for a, b in zip(q, seq))
    if len(seq) * max(q) * max(seq) <= 2 * useful + _PAD_SLACK:
        return [list(range(len(seq)))]
    order = sorted(range(len(seq)), key=lambda i: (-seq[i], -q[i]))
    groups: list[list[int]] = []
    cur: list[int] = []
    cur_useful = cur_L = cur_S = 0
    for i in order:
        L, S = max(cur_L, seq[i]), max(cur_S, q[i])
        u = cur_useful + q[i] * seq[i]
        if cur and (len(cur) + 1) * S * L > 2 * u + _PAD_SLACK:
            groups.append(cur)
            cur, cur_useful, cur_L, cur_S = [], 0, 0, 0
            L, S, u = seq[i], q[i], q[i] * seq[i]
        cur.append(i)
        cur_useful, cur_L, cur_S = u, L, S
    groups.append(cur)
    return groups


def _dense(mode: ForwardMode, kv: list[torch.Tensor], seq_l: list[int], ext_l: list[int], pre_l: list[int],
           decode: bool, device: torch.device) -> AttentionMetadata:
    """One padded group over the requests given (their new tokens flat, in order)."""
    B, T = len(seq_l), sum(ext_l)
    seq = torch.tensor(seq_l, dtype=torch.int64, device=device)
    ext = torch.tensor(ext_l, dtype=torch.int64, device=device)
    last = torch.cumsum(ext, 0) - 1
    kv_idx = torch.nn.utils.rnn.pad_sequence(kv, batch_first=True, padding_value=0)
    L = kv_idx.shape[1]
    keys = torch.arange(L, device=device)
    if decode:
        S = 1
        mask = (keys[None, :] < seq[:, None]).view(B, 1, 1, L)
        q_gather = q_scatter = None
    else:
        S = max(ext_l)
        prefix = torch.tensor(pre_l, dtype=torch.int64, device=device)
        qpos = torch.arange(S, device=device)
        limit = torch.minimum(prefix[:, None] + qpos[None, :] + 1, seq[:, None])  # [B, S]
        mask = (keys[None, None, :] < limit[:, :, None]).view(B, 1, S, L)
        starts = last - ext + 1  # flat index of each request's first new token
        flat = starts[:, None] + qpos[None, :]
        valid = qpos[None, :] < ext[:, None]
        q_gather = torch.where(valid, flat, torch.full_like(flat, T)).view(-1)
        q_scatter = (torch.arange(B, device=device)[:, None] * S + qpos[None, :])[valid]
    return AttentionMetadata(mode, None, None, kv_idx, mask, q_gather, q_scatter, last, B, S, T)


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


def attend(q: torch.Tensor, meta: AttentionMetadata, gather_kv, scale: float) -> torch.Tensor:
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
        kbuf, vbuf = pool.k_buffer[self.layer_id], pool.v_buffer[self.layer_id]
        out = attend(q, meta, lambda idx: (gather_rows(kbuf, idx), gather_rows(vbuf, idx)), self.scale)
        return self.o_proj(out.reshape(T, self.q_size))
