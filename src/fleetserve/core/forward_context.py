"""What every layer of one forward reads: :class:`ForwardContext`.

Built once per batch from the scheduler's :class:`ForwardBatch` by
:meth:`ForwardContext.build`: the attention layout (every request's KV slots
padded into one index matrix, the causal mask, the query gather/scatter
between the flat ``[T]`` token order and the padded ``[B, S]`` one, split
into a few sub-batches when padding would waste too much) and, under DP
attention, every attention group's token count for the FFN gather. The
attention kernels that use it live in :mod:`fleetserve.layers.attention`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fleetserve.core import fast_path
from fleetserve.core.forward_batch import ForwardBatch, ForwardMode
from fleetserve.core.kv_pool import contiguous_run


@dataclass
class ForwardContext:
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
        full_mask: True when every entry of ``mask`` is True (a DECODE group whose
            requests all have the same length, e.g. every batch of one request);
            :meth:`additive_mask` then gives None and attention runs unmasked.
        kv_start: with the fast path on and one request (``B == 1``) whose slots are one
            ascending run ``kv_start .. kv_start + L - 1`` (:func:`~fleetserve.core.kv_pool.contiguous_run`;
            the allocator's order makes that the usual case at concurrency 1): the first slot,
            and attention reads K/V as a view of the pool rows instead of gathering them; else None.
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
    groups: list["ForwardContext"] | None = None
    #: For a sub-batch: int64 ``[T_g]`` rows of the full batch's flat tokens it holds.
    token_idx: torch.Tensor | None = None
    full_mask: bool = False
    kv_start: int | None = None

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor | None:
        """``mask`` as 0 / -inf in ``dtype`` (built once per forward, shared by all layers),
        or None when nothing is masked (``full_mask``, with the fast path on)."""
        if self.full_mask and fast_path.ENABLED:
            return None
        cache = self.__dict__.setdefault("_additive", {})
        if dtype not in cache:
            m = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device)
            cache[dtype] = m.masked_fill_(~self.mask, float("-inf"))
        return cache[dtype]

    @classmethod
    def build(cls, batch: ForwardBatch, device: torch.device | str | None = None) -> "ForwardContext":
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
    within ``2 * useful + _PAD_SLACK`` (see :meth:`ForwardContext.build`)."""
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
           decode: bool, device: torch.device) -> ForwardContext:
    """One padded group over the requests given (their new tokens flat, in order)."""
    B, T = len(seq_l), sum(ext_l)
    seq = torch.tensor(seq_l, dtype=torch.int64, device=device)
    ext = torch.tensor(ext_l, dtype=torch.int64, device=device)
    last = torch.cumsum(ext, 0) - 1
    fast = fast_path.ENABLED
    kv_start = None
    if fast and B == 1:
        kv_idx = kv[0].reshape(1, -1)
        kv_start = contiguous_run(kv[0])
    else:
        kv_idx = torch.nn.utils.rnn.pad_sequence(kv, batch_first=True, padding_value=0)
    L = kv_idx.shape[1]
    keys = torch.arange(L, device=device)
    full = False
    if decode:
        S = 1
        mask = (keys[None, :] < seq[:, None]).view(B, 1, 1, L)
        q_gather = q_scatter = None
        full = fast and min(seq_l) == max(seq_l)  # every row of the mask is all True
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
    return ForwardContext(mode, None, None, kv_idx, mask, q_gather, q_scatter, last, B, S, T, full_mask=full,
                          kv_start=kv_start)
