"""Expert parallelism: send tokens to the ranks holding their experts, combine the results.

Each of the ``ep_size`` ranks holds a contiguous range of
``n_routed_experts / ep_size`` routed experts. The model computes the routing
(gate, top-k ids and weights) on every rank and hands the expert computation
to :class:`EPDispatcher` as a function:

``expert_fn(x, topk_ids, topk_weights) -> y``
    ``x``: ``[M, H]``; ``topk_ids``: int64 ``[M, K]`` *global* expert ids;
    ``topk_weights``: ``[M, K]``. Returns ``[M, H]`` with
    ``y[m] = sum_k topk_weights[m, k] * expert_{topk_ids[m, k]}(x[m])`` over the
    experts **this rank holds** (other ids contribute nothing). With
    ``moe_tp_size > 1`` it is this rank's partial sum over its slice of each
    expert's intermediate dimension.

Two back-ends (``--moe-a2a-backend``), same result up to float summation order:

``allgather``
    Every rank has every token (TP replicates them; DP attention gathers them
    first). Each rank runs ``expert_fn`` on all tokens, then one
    ``all_reduce`` over the TP group sums the ranks' partial outputs (both the
    expert split and the intermediate split).

``all_to_all``
    Each rank starts from its share of the tokens. Per destination rank it
    selects the tokens with at least one chosen expert there; the counts go
    first (``all_to_all_single`` of ``[ep_size]`` ints), then the rows, their
    ids and weights (``all_to_all_single`` with uneven splits). Each rank runs
    ``expert_fn`` on what it received and sends the weighted results back the
    same way; the sender adds them up per token. A token travels once to each
    rank holding one of its experts, never to the others. Requires
    ``ep_size == tp_size`` (no intermediate split).

When the ranks hold identical tokens (TP, or DP attention after its gather),
``all_to_all`` gives each rank an equal share to dispatch and all-gathers the
shares' outputs at the end; under DP attention the model may skip its gather
for MoE layers (:attr:`EPDispatcher.wants_dp_gather` is False) and each rank
dispatches its own group's tokens directly.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from fleetserve.distributed.comm_stats import timed
from fleetserve.distributed.parallel_state import ParallelState, shard_range

ExpertFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class EPDispatcher:
    """Routed-expert execution over the EP ranks of one MoE layer.

    Args:
        ps: this rank's parallel state (``ep_size``, groups, ``moe_a2a_backend``).
        n_routed_experts: experts per MoE layer (divisible by ``ep_size``).

    Attributes:
        expert_start, expert_end: ``[start, end)`` global ids of the local experts.
        last_sent_rows / last_received_rows: rows this rank sent / received in its last
            ``all_to_all`` dispatch (one per token and destination rank), for tests and stats.
    """

    def __init__(self, ps: ParallelState, n_routed_experts: int):
        self.ps = ps
        self.n_routed_experts = int(n_routed_experts)
        self.expert_start, self.expert_end = shard_range(self.n_routed_experts, ps.ep_rank, ps.ep_size)
        self.experts_per_rank = self.expert_end - self.expert_start
        self.last_sent_rows = 0
        self.last_received_rows = 0
        self.backend = ps.moe_a2a_backend if ps.ep_size > 1 else "allgather"
        if self.backend not in ("allgather", "all_to_all"):
            raise ValueError(f"unknown moe_a2a_backend {self.backend!r}")
        if self.backend == "all_to_all" and ps.moe_tp_size != 1:
            raise ValueError("all_to_all EP needs ep_size == tp_size (moe_tp_size 1), "
                             f"got ep {ps.ep_size}, moe_tp {ps.moe_tp_size}")

    @property
    def wants_dp_gather(self) -> bool:
        """Whether the tokens must be gathered over DP attention groups before this MoE."""
        return self.backend != "all_to_all"

    # ----------------------------------------------------------------- public
    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 expert_fn: ExpertFn, replicated_over_tp: bool = True) -> torch.Tensor:
        """Routed-expert output ``[N, H]`` for the rows of ``x``.

        Args:
            x: ``[N, H]`` tokens; ``topk_ids`` int64 ``[N, K]``; ``topk_weights`` ``[N, K]``.
            expert_fn: see module docstring.
            replicated_over_tp: every TP rank holds the same ``x`` (True for TP and for DP
                attention after its gather). False only for ``all_to_all`` under DP
                attention without the gather: then ``x`` is identical within each
                attention group and different across groups.

        Returns:
            ``[N, H]``: the sum over all chosen experts (fully reduced, on every rank).
        """
        if self.backend == "allgather":
            if not replicated_over_tp and self.ps.tp_size > 1:
                raise ValueError("allgather EP needs every rank to hold all tokens (gather them first)")
            return self._allgather(x, topk_ids, topk_weights, expert_fn)
        ps = self.ps
        if replicated_over_tp:
            size, rank, group = ps.tp_size, ps.tp_rank, ps.tp_group
        else:
            size, rank, group = ps.attn_tp_size, ps.attn_tp_rank, ps.attn_tp_group
        n = x.shape[0]
        sizes = [n // size + (1 if i < n % size else 0) for i in range(size)]
        start = sum(sizes[:rank])
        mine = slice(start, start + sizes[rank])
        y_mine = self._all_to_all(x[mine], topk_ids[mine], topk_weights[mine], expert_fn)
        if size == 1:
            return y_mine
        return _all_gather_uneven(y_mine, sizes, group)

    # --------------------------------------------------------------- allgather
    def _allgather(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, fn: ExpertFn) -> torch.Tensor:
        y = _run_experts(fn, x, ids, w)
        if self.ps.tp_size > 1:
            with timed("moe_all_reduce"):
                dist.all_reduce(y, group=self.ps.tp_group)
        return y

    # -------------------------------------------------------------- all_to_all
    def _all_to_all(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, fn: ExpertFn) -> torch.Tensor:
        ps = self.ps
        E, K, H = ps.ep_size, ids.shape[1], x.shape[1]
        group = ps.ep_group
        owner = torch.div(ids, self.experts_per_rank, rounding_mode="floor")  # [m, K] in [0, E)
        hit = torch.zeros(x.shape[0], E, dtype=torch.bool, device=x.device)
        hit.scatter_(1, owner, True)
        dest, token = hit.t().nonzero(as_tuple=True)  # sorted by destination, then token
        self.last_sent_rows = int(token.shape[0])
        # Counts live on x's device: gloo takes CPU tensors, NCCL device tensors.
        send_counts = torch.bincount(dest, minlength=E).to(torch.int64)
        recv_counts = torch.empty_like(send_counts)
        with timed("moe_all_to_all"):
            dist.all_to_all_single(recv_counts, send_counts, group=group)
        send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
        n_recv = int(sum(recv_splits))
        # Ids and weights travel together as float32 (ids are small integers: exact).
        meta = torch.cat([ids[token].to(torch.float32), w[token].to(torch.float32)], dim=1)
        recv_x = torch.empty(n_recv, H, dtype=x.dtype, device=x.device)
        recv_meta = torch.empty(n_recv, 2 * K, dtype=torch.float32, device=x.device)
        with timed("moe_all_to_all"):
            dist.all_to_all_single(recv_x, x[token].contiguous(), recv_splits, send_splits, group=group)
            dist.all_to_all_single(recv_meta, meta, recv_splits, send_splits, group=group)
        self.last_received_rows = n_recv
        out = _run_experts(fn, recv_x, recv_meta[:, :K].round().to(torch.int64), recv_meta[:, K:].to(w.dtype))
        back = torch.empty(int(token.shape[0]), H, dtype=out.dtype, device=x.device)
        with timed("moe_all_to_all"):
            dist.all_to_all_single(back, out.contiguous(), send_splits, recv_splits, group=group)
        y = torch.zeros(x.shape[0], H, dtype=out.dtype, device=x.device)
        y.index_add_(0, token, back)
        return y


def _run_experts(fn: ExpertFn, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if x.shape[0] == 0:
        return torch.zeros_like(x)
    return fn(x, ids, w)


def _all_gather_uneven(y: torch.Tensor, sizes: list[int], group: Any) -> torch.Tensor:
    """Concatenate every rank's ``y`` (``[sizes[r], ...]``) in rank order."""
    n_max = max(sizes)
    padded = y
    if y.shape[0] < n_max:
        padded = torch.zeros((n_max, *y.shape[1:]), dtype=y.dtype, device=y.device)
        padded[: y.shape[0]] = y
    parts = [torch.empty_like(padded) for _ in sizes]
    with timed("moe_all_gather"):
        dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([p[:n] for p, n in zip(parts, sizes)], dim=0)
