"""DP attention: per-step agreement between attention groups, and the FFN gather/scatter.

Under ``--enable-dp-attention`` each attention group (``attn_tp_size`` ranks)
schedules its own requests and keeps its own KV, but every MoE / dense FFN
layer spans all ranks. So the groups must agree, every step, on

* how many tokens each group brings (the shape of the FFN gather), and
* whether every group runs DECODE or IDLE (only then may a CUDA graph replay).

:func:`sync_step` does both with small collectives on the gloo CPU group:
an ``all_gather`` of token counts, then -- only when the caller may replay a
decode graph (``check_graph``; SGLang skips it under ``disable_cuda_graph``) --
an ``all_reduce(MIN)`` of "my batch is DECODE or IDLE". A rank with no batch while another has one must run an IDLE
batch (zero tokens) so that it still joins the FFN collectives; when every rank
is empty no rank steps. Idea from SGLang's ``prepare_dp_attn_batch`` (PR #1970,
#2061); see the reference chapter.

Around each FFN the model calls :func:`gather_tokens`, which concatenates
every group's hidden states (each padded to the largest count for the
``all_gather``, padding dropped after), and :func:`scatter_tokens`, which keeps
this group's own rows.

Scheduling rule under DP attention (:func:`dp_schedule_rule`): the step time of
every rank is the slowest rank's, and a retraction on one rank stalls them all,
so each rank reserves more KV for decode growth (conservativeness x 1.5) and
caps its prefill chunk at ``chunked_prefill_size // attn_dp_size`` so that the
gathered FFN batch stays within one rank's prefill budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fleetserve.distributed.comm_stats import timed
from fleetserve.distributed.parallel_state import ParallelState
from fleetserve.distributed.traceable import traced_all_gather

# Multiplier on schedule_conservativeness under DP attention (see module docstring).
DP_ATTENTION_CONSERVATIVENESS = 1.5


@dataclass
class DPStepPlan:
    """What this step looks like across the instance.

    Attributes:
        global_num_tokens: tokens of each attention group this step (index = ``attn_dp_rank``):
            DECODE: batch size, EXTEND: new tokens, no batch: 0.
        run_idle: this rank has no batch but another has one; it must run an IDLE batch.
        skip: every rank is empty; no rank steps (no forward, no collectives).
        can_run_graph: every group is DECODE or IDLE (all-reduce MIN); a decode graph may
            replay. Always False when :func:`sync_step` ran with ``check_graph=False``.
    """

    global_num_tokens: list[int]
    run_idle: bool
    skip: bool
    can_run_graph: bool

    @property
    def max_num_tokens(self) -> int:
        return max(self.global_num_tokens) if self.global_num_tokens else 0


def batch_num_tokens(mode: Any, num_tokens: int, batch_size: int) -> int:
    """The count a rank reports: DECODE -> batch size, EXTEND -> new tokens, none/IDLE -> 0."""
    if mode is None or mode.is_idle():
        return 0
    if mode.is_decode():
        return int(batch_size)
    return int(num_tokens)


def sync_step(ps: ParallelState, local_num_tokens: int, local_decode_or_idle: bool,
              check_graph: bool = True) -> DPStepPlan:
    """Agree on this step's shape with every rank (call once per step, on every rank).

    Args:
        ps: this rank's state (uses ``cpu_group``; a no-op plan when ``attn_dp_size == 1``).
        local_num_tokens: from :func:`batch_num_tokens` (0 when this rank has no batch).
        local_decode_or_idle: this rank's batch is DECODE, or it has none.
        check_graph: also run the all-reduce(MIN) for decode-graph eligibility; pass False
            when this rank cannot replay a graph (one collective fewer per step).

    Returns:
        The :class:`DPStepPlan`; identical on every rank except ``run_idle``.

    Raises:
        RuntimeError: ranks of one attention group disagree on their count (desync), or a
        peer failed / timed out (from ``torch.distributed``).
    """
    if ps.attn_dp_size <= 1:
        # One attention group: every rank runs the same batch; nothing to agree on.
        return DPStepPlan([int(local_num_tokens)], run_idle=False, skip=local_num_tokens == 0,
                          can_run_graph=bool(local_decode_or_idle) and check_graph)
    mine = torch.tensor([int(local_num_tokens)], dtype=torch.int64)
    parts = [torch.empty(1, dtype=torch.int64) for _ in range(ps.tp_size)]
    with timed("dp_sync"):
        dist.all_gather(parts, mine, group=ps.cpu_group)
    per_rank = [int(p.item()) for p in parts]
    a = ps.attn_tp_size
    per_group = [per_rank[d * a] for d in range(ps.attn_dp_size)]
    for d in range(ps.attn_dp_size):
        if len(set(per_rank[d * a:(d + 1) * a])) != 1:
            raise RuntimeError(f"attention group {d} ranks disagree on this step's tokens: "
                               f"{per_rank[d * a:(d + 1) * a]} (schedulers out of step)")
    if max(per_group) == 0:
        return DPStepPlan(per_group, run_idle=False, skip=True, can_run_graph=False)
    can_graph = False
    if check_graph:
        flag = torch.tensor([1 if local_decode_or_idle else 0], dtype=torch.int32)
        with timed("dp_sync"):
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=ps.cpu_group)
        can_graph = int(flag.item()) == 1
    return DPStepPlan(per_group, run_idle=local_num_tokens == 0, skip=False, can_run_graph=can_graph)


def gather_tokens(x: torch.Tensor, global_num_tokens: list[int], ps: ParallelState) -> torch.Tensor:
    """All attention groups' rows, concatenated in ``attn_dp_rank`` order.

    Args:
        x: ``[n_own, ...]`` this group's rows (``n_own == global_num_tokens[attn_dp_rank]``).
        global_num_tokens: rows per group (from :func:`sync_step`).

    Returns:
        ``[sum(global_num_tokens), ...]``, same dtype and device; ``x`` itself when there
        is one attention group.
    """
    if ps.attn_dp_size <= 1:
        return x
    n_own = int(global_num_tokens[ps.attn_dp_rank])
    if x.shape[0] != n_own:
        raise ValueError(f"rank has {x.shape[0]} rows but global_num_tokens says {n_own}")
    n_max = max(global_num_tokens)
    if n_max == 0:
        return x
    padded = x
    if n_own < n_max:
        padded = torch.zeros((n_max, *x.shape[1:]), dtype=x.dtype, device=x.device)
        padded[:n_own] = x
    if torch.compiler.is_compiling():  # the compiled decode step (distributed/traceable.py)
        parts = list(traced_all_gather(padded, ps.attn_dp_group, ps.attn_dp_size, "dp_gather").unbind(0))
    else:
        parts = [torch.empty_like(padded) for _ in range(ps.attn_dp_size)]
        with timed("dp_gather"):
            dist.all_gather(parts, padded.contiguous(), group=ps.attn_dp_group)
    return torch.cat([p[:n] for p, n in zip(parts, global_num_tokens)], dim=0)


def scatter_tokens(x_all: torch.Tensor, global_num_tokens: list[int], ps: ParallelState) -> torch.Tensor:
    """This group's rows of ``x_all`` (``[sum(global_num_tokens), ...]``); no communication."""
    if ps.attn_dp_size <= 1:
        return x_all
    start = int(sum(global_num_tokens[: ps.attn_dp_rank]))
    return x_all[start: start + int(global_num_tokens[ps.attn_dp_rank])]


def dp_schedule_rule(schedule_conservativeness: float, chunked_prefill_size: int | None,
                     attn_dp_size: int) -> tuple[float, int | None]:
    """The scheduling limits one rank uses under DP attention (see module docstring).

    Returns:
        ``(conservativeness, chunk_size)``: conservativeness x 1.5, and the prefill chunk
        divided by the number of attention groups (at least 1; ``None`` or ``-1``, i.e.
        no chunking, stay as they are).
    """
    if attn_dp_size <= 1:
        return schedule_conservativeness, chunked_prefill_size
    chunk = chunked_prefill_size
    if chunk is not None and chunk > 0:  # None / -1: chunking off, and stays off
        chunk = max(1, chunk // attn_dp_size)
    return schedule_conservativeness * DP_ATTENTION_CONSERVATIVENESS, chunk
