"""EP MoE over several gloo ranks equals the single-rank MoE, for both back-ends."""

import torch
import torch.nn.functional as F

from fleetserve.distributed.dp_attention import gather_tokens, scatter_tokens
from fleetserve.distributed.moe_dispatch import EPDispatcher
from fleetserve.testing.rank_pool import build_state

E, H, I, K = 8, 16, 12, 2


def weights():
    g = torch.Generator().manual_seed(7)
    return torch.randn(E, 2 * I, H, generator=g) * 0.4, torch.randn(E, H, I, generator=g) * 0.4


def tokens(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, H, generator=g)
    logits = torch.randn(n, E, generator=g) * 2.0
    w, ids = torch.softmax(logits, dim=-1).topk(K, dim=-1)
    return x, ids, w


def make_expert_fn(start, end, islice=slice(0, I)):
    """Weighted sum over experts [start, end), using only intermediate columns ``islice``."""
    w_gu, w_down = weights()

    def fn(x, ids, w):
        y = torch.zeros_like(x)
        for e in range(start, end):
            hit = ids == e
            rows = hit.any(dim=1).nonzero(as_tuple=True)[0]
            if rows.numel() == 0:
                continue
            weight = (w * hit).sum(dim=1)[rows]
            gate, up = w_gu[e, :I][islice], w_gu[e, I:][islice]
            h = F.silu(x[rows] @ gate.t()) * (x[rows] @ up.t())
            y[rows] += weight[:, None] * (h @ w_down[e][:, islice].t())
        return y

    return fn


def reference(n, seed):
    x, ids, w = tokens(n, seed)
    return make_expert_fn(0, E)(x, ids, w)


def rank_expert_fn(ps):
    disp = EPDispatcher(ps, E)  # the dispatcher's own split of the experts over EP ranks
    start, end = disp.expert_start, disp.expert_end
    step = I // ps.moe_tp_size
    return make_expert_fn(start, end, slice(ps.moe_tp_rank * step, (ps.moe_tp_rank + 1) * step))


def replicated_job(rank, world, kw, n):
    """Every rank holds the same n tokens (TP, or DP attention after its gather)."""
    ps = build_state(rank, **kw)
    disp = EPDispatcher(ps, E)
    x, ids, w = tokens(n, seed=1)
    y = disp(x, ids, w, rank_expert_fn(ps))
    return y, disp.last_sent_rows


def dp_attention_job(rank, world, kw, counts, gather_first):
    """Each attention group holds its own tokens; MoE with or without the DP gather."""
    ps = build_state(rank, **kw)
    disp = EPDispatcher(ps, E)
    x, ids, w = tokens(counts[ps.attn_dp_rank], seed=10 + ps.attn_dp_rank)
    fn = rank_expert_fn(ps)
    if gather_first:
        xa, ia, wa = (gather_tokens(t, counts, ps) for t in (x, ids, w))
        return scatter_tokens(disp(xa, ia, wa, fn), counts, ps)
    return disp(x, ids, w, fn, replicated_over_tp=False)


def _check_replicated(pool, kw, n):
    got = pool.run(__file__, "replicated_job", kw, n)
    want = reference(n, seed=1)
    for y, _ in got:
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    return got


def test_ep2_both_backends_and_tp2_match_single_rank(pool2):
    for kw in (dict(tp_size=2, ep_size=2, moe_a2a_backend="allgather"),
               dict(tp_size=2, ep_size=2, moe_a2a_backend="all_to_all"),
               dict(tp_size=2)):  # ep 1: every expert's intermediate split over 2 ranks
        for n in (9, 1, 0):
            _check_replicated(pool2, kw, n)


def test_all_to_all_sends_each_token_only_to_ranks_with_its_experts(pool2):
    n = 9
    got = _check_replicated(pool2, dict(tp_size=2, ep_size=2, moe_a2a_backend="all_to_all"), n)
    _, ids, _ = tokens(n, seed=1)
    owner = ids // (E // 2)
    # rank r dispatches tokens [5*r, ...) of the 9 (shares 5 and 4); one row per distinct owner
    shares = [range(0, 5), range(5, 9)]
    for r in range(2):
        expect = sum(len(set(owner[t].tolist())) for t in shares[r])
        assert got[r][1] == expect
        assert expect < len(shares[r]) * 2  # fewer than "every token to every rank"


def test_dp_attention_with_ep2_both_backends_uneven_and_empty(pool2):
    for backend in ("allgather", "all_to_all"):
        kw = dict(tp_size=2, dp_size=2, enable_dp_attention=True, ep_size=2, moe_a2a_backend=backend)
        for counts in ([5, 3], [0, 4], [2, 0]):
            modes = (True, False) if backend == "all_to_all" else (True,)
            for gather_first in modes:
                got = pool2.run(__file__, "dp_attention_job", kw, counts, gather_first)
                for d in range(2):
                    torch.testing.assert_close(got[d], reference(counts[d], seed=10 + d), rtol=1e-5, atol=1e-5)


def test_four_rank_layouts(pool4):
    # expert split over 2 ranks and each expert's intermediate over 2 (allgather)
    _check_replicated(pool4, dict(tp_size=4, ep_size=2), 7)
    _check_replicated(pool4, dict(tp_size=4, ep_size=4, moe_a2a_backend="all_to_all"), 7)
    # two attention groups of two ranks each, all_to_all without the DP gather
    kw = dict(tp_size=4, dp_size=2, enable_dp_attention=True, ep_size=4, moe_a2a_backend="all_to_all")
    got = pool4.run(__file__, "dp_attention_job", kw, [3, 6], False)
    for r in range(4):
        d = r // 2
        torch.testing.assert_close(got[r], reference([3, 6][d], seed=10 + d), rtol=1e-5, atol=1e-5)
