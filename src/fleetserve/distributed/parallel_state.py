"""Who this rank is and which process groups it talks over.

Sizes follow SGLang's meaning (see ARCHITECTURE.md):

* ``tp_size`` ranks make one instance; the MoE / dense FFN span all of them.
* Without DP attention, attention heads are split over all ``tp_size`` ranks
  (``attn_tp_size == tp_size``, ``attn_dp_size == 1``).
* With DP attention and ``dp_size = D``, the ranks form ``D`` attention groups
  of ``attn_tp_size = tp_size // D`` ranks; each group schedules its own
  requests and keeps its own KV.
* ``ep_size`` ranks split the routed experts (``n_routed_experts / ep_size``
  each, contiguous ranges); ``moe_tp_size = tp_size // ep_size`` ranks split each
  expert's intermediate dimension.

Every helper here is a no-op (or identity) when the group has one rank, so
single-rank code paths pay nothing. The models take a :class:`ParallelState`
and never call ``torch.distributed`` directly except through these helpers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fleetserve.distributed.comm_stats import timed
from fleetserve.distributed.traceable import traced_all_gather, traced_all_reduce


@dataclass
class ParallelState:
    """Ranks and groups of one model-runner process.

    Attributes:
        tp_rank, tp_size: position in / size of the instance's full group.
        attn_tp_rank, attn_tp_size: within this rank's attention group
            (heads are split over it).
        attn_dp_rank, attn_dp_size: which attention group / how many (DP attention).
        ep_rank, ep_size: expert-parallel position / size (experts split over it).
        moe_tp_rank, moe_tp_size: within an expert, the intermediate dim is split over it.
        tp_group: device group over all ``tp_size`` ranks (None when single).
        attn_tp_group: device group of this rank's attention group.
        attn_dp_group: device group of the ranks sharing this rank's ``attn_tp_rank``
            across attention groups (DP attention gathers tokens over it).
        ep_group / moe_tp_group: groups for expert dispatch and expert-TP reduce.
        cpu_group: gloo group over all ranks, for small per-step control collectives.
        attn_tp_cpu_group: gloo group of this rank's attention group (the group's first
            rank broadcasts the requests it received to the others).
        moe_a2a_backend: ``"allgather"`` or ``"all_to_all"`` (EP token dispatch).
        device: torch device of this rank.
    """

    tp_rank: int = 0
    tp_size: int = 1
    attn_tp_rank: int = 0
    attn_tp_size: int = 1
    attn_dp_rank: int = 0
    attn_dp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    moe_tp_rank: int = 0
    moe_tp_size: int = 1
    tp_group: Any = None
    attn_tp_group: Any = None
    attn_dp_group: Any = None
    ep_group: Any = None
    moe_tp_group: Any = None
    cpu_group: Any = None
    attn_tp_cpu_group: Any = None
    moe_a2a_backend: str = "allgather"
    device: str = "cpu"

    @property
    def enable_dp_attention(self) -> bool:
        return self.attn_dp_size > 1


SINGLE_RANK_STATE = ParallelState()


def all_reduce(x: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    """Sum ``x`` over ``group`` in place (identity when ``size == 1``); while ``torch.compile``
    traces, a new tensor from the opaque op of :mod:`fleetserve.distributed.traceable`."""
    if size > 1 and torch.compiler.is_compiling():
        return traced_all_reduce(x, group)
    if size > 1:
        with timed("all_reduce"):
            dist.all_reduce(x, group=group)
    return x


def all_gather_cat(x: torch.Tensor, group: Any, size: int, dim: int = -1) -> torch.Tensor:
    """Gather equal-shaped ``x`` from every rank of ``group`` and concatenate on ``dim``."""
    if size == 1:
        return x
    if torch.compiler.is_compiling():
        return torch.cat(list(traced_all_gather(x, group, size).unbind(0)), dim=dim)
    parts = [torch.empty_like(x) for _ in range(size)]
    with timed("all_gather"):
        dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def shard_range(total: int, rank: int, size: int) -> tuple[int, int]:
    """Contiguous ``[start, end)`` of ``total`` items owned by ``rank`` of ``size``.

    Raises ValueError if ``total`` is not divisible by ``size``.
    """
    if total % size != 0:
        raise ValueError(f"{total} is not divisible by {size}")
    per = total // size
    return rank * per, (rank + 1) * per
