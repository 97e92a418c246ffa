"""DeepSeek mixture of experts: a gate, routed experts, shared experts.

Routing (computed in float32, replicated on every rank, so every rank picks
the same experts for a token):

* DeepSeek-V2 (``scoring="softmax"``): ``scores = softmax(x @ W_g.T)``.
  ``greedy`` takes the top-k scores; ``group_limited_greedy`` first keeps the
  ``topk_group`` groups (of ``n_group``) with the highest per-group maximum,
  then takes the top-k inside them. Weights: the chosen scores, divided by
  their sum when ``norm_topk_prob``, otherwise times ``routed_scaling_factor``
  (DeepSeek-V2's modelling code).
* DeepSeek-V3 (``scoring="sigmoid"``, ``noaux_tc``): ``scores = sigmoid(x @
  W_g.T)``; for *selection only* add ``e_score_correction_bias``; keep the
  ``topk_group`` groups with the largest sum of their two best biased scores,
  take the top-k biased scores inside them. Weights: the *unbiased* scores of
  the chosen experts, normalised when ``norm_topk_prob``, then times
  ``routed_scaling_factor`` (DeepSeek-V3 report, sec. 2.1.2).

Routed experts live as one contiguous range ``[start, end) =
shard_range(n_routed_experts, ep_rank, ep_size)`` per rank; inside an
expert the intermediate dim is split over the MoE-TP group. The expert
computation is one function of ``(tokens, topk_ids, topk_weights)``
(:meth:`RoutedExperts.forward`) that adds up only the local experts'
contributions, so an EP dispatcher (all-gather or all-to-all) can be placed
around it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fleetserve.distributed.parallel_state import SINGLE_RANK_STATE, ParallelState, all_reduce, shard_range
from fleetserve.distributed.moe_dispatch import EPDispatcher
from fleetserve.layers.linear import UNSHARDED, full_tp_group
from fleetserve.layers.mlp import GatedMLP, activation


def select_experts(logits: torch.Tensor, top_k: int, scoring: str, topk_method: str, n_group: int | None,
                   topk_group: int | None, norm_topk_prob: bool, routed_scaling_factor: float,
                   correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose ``top_k`` experts per token.

    Args:
        logits: float32 ``[T, E]`` router logits.
        scoring: ``"softmax"`` (V2) or ``"sigmoid"`` (V3).
        topk_method: ``"greedy"``, ``"group_limited_greedy"`` (V2) or ``"noaux_tc"`` (V3).
        n_group, topk_group: expert groups and how many of them a token may use.
        correction_bias: float32 ``[E]`` added to the scores for selection only (V3).

    Returns ``(topk_weights float32 [T, k], topk_ids int64 [T, k])``.
    Raises ValueError on unknown scoring / method.
    """
    T, E = logits.shape
    if scoring == "softmax":
        scores = logits.softmax(dim=-1)
    elif scoring == "sigmoid":
        scores = logits.sigmoid()
    else:
        raise ValueError(f"unknown scoring function {scoring!r}")
    choice = scores if correction_bias is None else scores + correction_bias
    grouped = topk_method in ("group_limited_greedy", "noaux_tc") and n_group and n_group > 1
    if grouped:
        per = choice.view(T, n_group, E // n_group)
        if topk_method == "noaux_tc":
            group_scores = per.topk(min(2, E // n_group), dim=-1)[0].sum(dim=-1)
        else:
            group_scores = per.max(dim=-1).values
        group_idx = group_scores.topk(topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        keep = group_mask.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E)
        fill = float("-inf") if topk_method == "noaux_tc" else 0.0
        choice = choice.masked_fill(~keep, fill)
    elif topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise ValueError(f"unknown topk_method {topk_method!r}")
    topk_ids = choice.topk(top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, topk_ids) if correction_bias is not None else choice.gather(1, topk_ids)
    if scoring == "softmax":
        if norm_topk_prob and top_k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        else:
            weights = weights * routed_scaling_factor
    else:
        if norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * routed_scaling_factor
    return weights, topk_ids


class TopKGate(nn.Module):
    """The router: ``weight [E, H]`` and (V3) ``e_score_correction_bias [E]``, kept in float32."""

    def __init__(self, hidden_size: int, n_experts: int, top_k: int, scoring: str, topk_method: str,
                 n_group: int | None, topk_group: int | None, norm_topk_prob: bool, routed_scaling_factor: float,
                 with_bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n_experts, hidden_size, dtype=torch.float32), requires_grad=False)
        self.e_score_correction_bias = (nn.Parameter(torch.zeros(n_experts, dtype=torch.float32), requires_grad=False)
                                        if with_bias else None)
        self.top_k, self.scoring, self.topk_method = top_k, scoring, topk_method
        self.n_group, self.topk_group = n_group, topk_group
        self.norm_topk_prob, self.routed_scaling_factor = norm_topk_prob, routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, H]`` -> ``(topk_weights float32 [T, k], topk_ids int64 [T, k])``."""
        logits = F.linear(x.float(), self.weight)
        return select_experts(logits, self.top_k, self.scoring, self.topk_method, self.n_group, self.topk_group,
                              self.norm_topk_prob, self.routed_scaling_factor, self.e_score_correction_bias)


class RoutedExperts(nn.Module):
    """This rank's routed experts ``[start, end)``, stacked.

    ``w13 [E_local, 2 * I_local, H]`` (gate rows then up rows) and
    ``w2 [E_local, H, I_local]``, where ``I_local`` is this rank's share of
    ``moe_intermediate_size`` over the MoE-TP group.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, n_experts: int, hidden_act: str,
                 pstate: ParallelState = SINGLE_RANK_STATE, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.n_experts = n_experts
        self.start, self.end = shard_range(n_experts, pstate.ep_rank, pstate.ep_size)
        self.inter_start, self.inter_end = shard_range(intermediate_size, pstate.moe_tp_rank, pstate.moe_tp_size)
        n_local, inter = self.end - self.start, self.inter_end - self.inter_start
        self.inter = inter
        self.w13 = nn.Parameter(torch.zeros(n_local, 2 * inter, hidden_size, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.zeros(n_local, hidden_size, inter, dtype=dtype), requires_grad=False)
        self.act = activation(hidden_act)

    def load(self, source: Any, prefix: str) -> None:
        """Read only the local experts' slices from ``{prefix}.{e}.{gate,up,down}_proj.weight``
        (per-expert checkpoints) or the fused ``{prefix}.gate_up_proj`` / ``down_proj``."""
        a, b, I = self.inter_start, self.inter_end, self.inter
        if source.has(f"{prefix}.gate_up_proj"):
            full_inter = source.shape(f"{prefix}.down_proj")[-1]
            gu = source.read(f"{prefix}.gate_up_proj", 0, self.start, self.end)
            self.w13[:, :I].copy_(gu[:, a:b])
            self.w13[:, I:].copy_(gu[:, full_inter + a:full_inter + b])
            self.w2.copy_(source.read(f"{prefix}.down_proj", 0, self.start, self.end)[:, :, a:b])
            return
        for local, e in enumerate(range(self.start, self.end)):
            p = f"{prefix}.{e}"
            self.w13[local, :I].copy_(source.read(f"{p}.gate_proj.weight", 0, a, b))
            self.w13[local, I:].copy_(source.read(f"{p}.up_proj.weight", 0, a, b))
            self.w2[local].copy_(source.read(f"{p}.down_proj.weight", 1, a, b))

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Sum of the local experts' outputs for each token.

        Args:
            x: ``[N, H]`` tokens.
            topk_ids: int64 ``[N, k]`` global expert ids (non-local ones are skipped).
            topk_weights: float32 ``[N, k]`` routing weights.

        Returns ``[N, H]`` in ``x``'s dtype: ``sum_j w[n, j] * expert_{ids[n, j]}(x[n])``
        over the ``j`` whose expert is local (a partial sum when experts are split
        over ranks, or when ``I_local < moe_intermediate_size``).
        """
        N, k = topk_ids.shape
        out = torch.zeros_like(x)
        if N == 0:
            return out
        flat = topk_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.n_experts).tolist()
        weights = topk_weights.reshape(-1).to(x.dtype)
        begin = sum(counts[: self.start])
        for local, e in enumerate(range(self.start, self.end)):
            n = counts[e]
            if n == 0:
                continue
            idx = order[begin:begin + n]
            begin += n
            tok = idx // k
            gate_up = F.linear(x.index_select(0, tok), self.w13[local])
            h = self.act(gate_up[:, : self.inter]) * gate_up[:, self.inter:]
            y = F.linear(h, self.w2[local]) * weights.index_select(0, idx).unsqueeze(-1)
            out.index_add_(0, tok, y)
        return out


class DeepseekMoE(nn.Module):
    """Gate + routed experts + shared experts of one DeepSeek layer.

    ``forward(x [N, H]) -> [N, H]``: route (replicated), run the local routed
    experts (:meth:`RoutedExperts.forward`), add the shared experts (split over
    the full TP group), then one all-reduce over the TP group sums the partial
    outputs of every rank. With one rank everything is local and the
    reduction is a no-op.
    """

    #: Routing reads expert counts on the host (``bincount(...).tolist()``) and sizes each
    #: expert's matmul by them, so a CUDA graph cannot capture it (the model runner checks).
    cuda_graph_safe = False

    def __init__(self, config: Any, pstate: ParallelState = SINGLE_RANK_STATE, dtype: torch.dtype = torch.float32):
        super().__init__()
        is_v3 = getattr(config, "model_type", "") == "deepseek_v3"
        scoring = getattr(config, "scoring_func", None) or ("sigmoid" if is_v3 else "softmax")
        method = getattr(config, "topk_method", None) or ("noaux_tc" if is_v3 else "greedy")
        n_experts = config.n_routed_experts
        self.pstate = pstate
        self.tp = full_tp_group(pstate)
        self.gate = TopKGate(config.hidden_size, n_experts, config.num_experts_per_tok, scoring, method,
                             getattr(config, "n_group", None), getattr(config, "topk_group", None),
                             bool(getattr(config, "norm_topk_prob", False)),
                             float(getattr(config, "routed_scaling_factor", 1.0)), with_bias=method == "noaux_tc")
        self.experts = RoutedExperts(config.hidden_size, config.moe_intermediate_size, n_experts, config.hidden_act,
                                     pstate, dtype)
        # Expert parallelism: the dispatcher moves tokens to the ranks holding
        # their experts; shared experts are then replicated (not TP-split) on every rank.
        self.dispatcher = EPDispatcher(pstate, n_experts) if pstate.ep_size > 1 else None
        n_shared = getattr(config, "n_shared_experts", 0) or 0
        shared_tp = UNSHARDED if self.dispatcher is not None else self.tp
        self.shared_experts = (GatedMLP(config.hidden_size, config.moe_intermediate_size * n_shared,
                                        config.hidden_act, tp=shared_tp, dtype=dtype, reduce_results=False)
                               if n_shared else None)

    def load(self, source: Any, prefix: str) -> None:
        self.gate.weight.copy_(source.read(f"{prefix}.gate.weight"))
        if self.gate.e_score_correction_bias is not None:
            self.gate.e_score_correction_bias.copy_(source.read(f"{prefix}.gate.e_score_correction_bias"))
        self.experts.load(source, f"{prefix}.experts")
        if self.shared_experts is not None:
            self.shared_experts.load(source, f"{prefix}.shared_experts")

    def forward(self, x: torch.Tensor, replicated_over_tp: bool = True) -> torch.Tensor:
        topk_weights, topk_ids = self.gate(x)
        if self.dispatcher is not None:  # EP: allgather or all_to_all (fleetserve.distributed.moe_dispatch)
            out = self.dispatcher(x, topk_ids, topk_weights, self.experts, replicated_over_tp)
            return out + self.shared_experts(x) if self.shared_experts is not None else out
        out = self.experts(x, topk_ids, topk_weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return all_reduce(out, self.tp.group, self.tp.size)
