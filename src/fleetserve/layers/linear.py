"""Tensor-parallel linears, vocab-parallel embedding and LM head.

Each layer knows its share of the full weight and loads only that share from
a *weight source* (any object with ``read(name, dim=None, start=None,
end=None) -> torch.Tensor`` returning the slice ``[start, end)`` of tensor
``name`` along ``dim``; see :mod:`fleetserve.models.loader`). Reductions go
through :mod:`fleetserve.distributed.parallel_state` helpers, which are
identities on one rank, so single-rank code pays nothing.

Sharding (Megatron-LM, Shoeybi et al. 2019):

* :class:`ColumnParallelLinear` splits the output features: rank ``r`` of
  ``n`` holds rows ``[r*o/n, (r+1)*o/n)`` of every fused part (e.g. the gate
  and up projections, or Q, K and V); no communication.
* :class:`RowParallelLinear` splits the input features; the partial products
  are summed with an all-reduce (or left partial with ``reduce_results=False``
  so that the caller can fuse several reductions into one).
* :class:`VocabParallelEmbedding` / :class:`ParallelLMHead` split the vocabulary
  rows (padded to a multiple of ``n``); lookup is masked and all-reduced,
  logits are all-gathered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fleetserve.distributed.parallel_state import ParallelState, all_gather_cat, all_reduce, shard_range
from fleetserve.layers.cpu_gemm import PackedLinear
from fleetserve.layers.opaque_gemm import linear_gemm


@dataclass(frozen=True)
class TPGroup:
    """One sharding group: this rank's position, the group size, the torch group."""

    rank: int = 0
    size: int = 1
    group: Any = None


UNSHARDED = TPGroup()


def attn_tp_group(p: ParallelState) -> TPGroup:
    """Attention heads, embedding and LM head are split over the attention-TP group."""
    return TPGroup(p.attn_tp_rank, p.attn_tp_size, p.attn_tp_group)


def full_tp_group(p: ParallelState) -> TPGroup:
    """Dense FFN and shared experts are split over all ``tp_size`` ranks."""
    return TPGroup(p.tp_rank, p.tp_size, p.tp_group)


def moe_tp_group(p: ParallelState) -> TPGroup:
    """Inside one routed expert, the intermediate dim is split over the MoE-TP group."""
    return TPGroup(p.moe_tp_rank, p.moe_tp_size, p.moe_tp_group)


def _copy_into(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{what}: expected shape {tuple(dst.shape)}, got {tuple(src.shape)}")
    dst.copy_(src.to(dst.dtype))


class ColumnParallelLinear(nn.Module):
    """``y = x @ W.T (+ b)`` with ``W`` split by output rows.

    Args:
        in_features: input size.
        output_sizes: full output size of each fused part (``[o]`` for a plain
            linear, ``[inter, inter]`` for gate+up, ``[q, k, v]`` for QKV).
        bias: whether a bias exists (sharded like the rows).
        tp: the sharding group.
        dtype: parameter dtype.
        shard_rows: optional per-part ``(start, end)`` rows of the full part
            this rank holds (default: the even split ``shard_range``); used
            for K/V heads replicated over more ranks than heads.

    Input ``[N, in_features]``, output ``[N, sum(local part sizes)]`` in
    the parameter dtype.
    """

    def __init__(self, in_features: int, output_sizes: int | Sequence[int], bias: bool = False,
                 tp: TPGroup = UNSHARDED, dtype: torch.dtype = torch.float32,
                 shard_rows: Sequence[tuple[int, int]] | None = None):
        super().__init__()
        sizes = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        if shard_rows is None:
            shard_rows = [shard_range(o, tp.rank, tp.size) for o in sizes]
        self.in_features = in_features
        self.tp = tp
        self.shard_rows = list(shard_rows)
        self.local_sizes = [e - s for s, e in self.shard_rows]
        self.offsets = [sum(self.local_sizes[:i]) for i in range(len(sizes))]
        out = sum(self.local_sizes)
        self.weight = nn.Parameter(torch.empty(out, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out, dtype=dtype), requires_grad=False) if bias else None
        self._gemm = PackedLinear()

    def load(self, source: Any, name: str, part: int = 0, bias_name: str | None = None) -> None:
        """Read this rank's rows of part ``part`` from tensor ``name`` (``[o, in]``)."""
        start, end = self.shard_rows[part]
        off, n = self.offsets[part], self.local_sizes[part]
        _copy_into(self.weight[off:off + n], source.read(name, 0, start, end), name)
        if bias_name is not None and self.bias is not None:
            _copy_into(self.bias[off:off + n], source.read(bias_name, 0, start, end), bias_name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_gemm(self, x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_local @ W_local.T) (+ b)`` with ``W`` split by input columns.

    Args:
        in_features: full input size (each rank gets ``in_features / tp.size``).
        out_features: output size.
        bias: added once, after the reduction.
        tp: the sharding group.
        reduce_results: False leaves the output partial (the caller reduces).

    Input ``[N, in_features / tp.size]``, output ``[N, out_features]``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp: TPGroup = UNSHARDED,
                 dtype: torch.dtype = torch.float32, reduce_results: bool = True):
        super().__init__()
        self.tp = tp
        self.col_start, self.col_end = shard_range(in_features, tp.rank, tp.size)
        self.reduce_results = reduce_results
        self.weight = nn.Parameter(torch.empty(out_features, self.col_end - self.col_start, dtype=dtype),
                                   requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None
        self._gemm = PackedLinear()

    def load(self, source: Any, name: str, bias_name: str | None = None) -> None:
        _copy_into(self.weight, source.read(name, 1, self.col_start, self.col_end), name)
        if bias_name is not None and self.bias is not None:
            _copy_into(self.bias, source.read(bias_name), bias_name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear_gemm(self, x, self.weight)
        if self.reduce_results:
            y = all_reduce(y, self.tp.group, self.tp.size)
        if self.bias is not None:
            y = y + self.bias
        return y


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split over ``tp``.

    The vocabulary is padded to ``padded = ceil(vocab / n) * n`` rows; rank
    ``r`` holds rows ``[r*padded/n, (r+1)*padded/n)`` (rows past ``vocab`` are
    zero). ``forward(ids [T] int64) -> [T, hidden]``.
    """

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup = UNSHARDED, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.vocab_size = vocab_size
        self.tp = tp
        self.padded_vocab = -(-vocab_size // tp.size) * tp.size
        self.start, self.end = shard_range(self.padded_vocab, tp.rank, tp.size)
        self.weight = nn.Parameter(torch.zeros(self.end - self.start, hidden_size, dtype=dtype), requires_grad=False)

    def load(self, source: Any, name: str) -> None:
        real_end = min(self.end, self.vocab_size)
        if real_end > self.start:
            _copy_into(self.weight[: real_end - self.start], source.read(name, 0, self.start, real_end), name)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        inside = (ids >= self.start) & (ids < self.end)
        local = torch.where(inside, ids - self.start, torch.zeros_like(ids))
        out = F.embedding(local, self.weight)
        out = out * inside.unsqueeze(-1).to(out.dtype)
        return all_reduce(out, self.tp.group, self.tp.size)


class ParallelLMHead(nn.Module):
    """Logits ``[N, vocab]`` float32 from hidden states ``[N, hidden]``.

    The vocabulary rows are split like :class:`VocabParallelEmbedding`; every
    rank computes its rows' logits and an all-gather assembles the full
    vocabulary. With ``tied_to`` the embedding's weight is shared (tied
    embeddings, e.g. SmolLM2).
    """

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup = UNSHARDED,
                 dtype: torch.dtype = torch.float32, tied_to: VocabParallelEmbedding | None = None):
        super().__init__()
        self.vocab_size = vocab_size
        self.tp = tp
        self.padded_vocab = -(-vocab_size // tp.size) * tp.size
        self.start, self.end = shard_range(self.padded_vocab, tp.rank, tp.size)
        self.tied = tied_to is not None
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(torch.zeros(self.end - self.start, hidden_size, dtype=dtype),
                                       requires_grad=False)
        self._gemm = PackedLinear()

    def load(self, source: Any, name: str) -> None:
        real_end = min(self.end, self.vocab_size)
        if real_end > self.start:
            _copy_into(self.weight[: real_end - self.start], source.read(name, 0, self.start, real_end), name)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear_gemm(self, hidden, self.weight)
        logits = all_gather_cat(logits, self.tp.group, self.tp.size, dim=-1)
        if self.padded_vocab != self.vocab_size:
            logits = logits[:, : self.vocab_size]
        return logits.float()
