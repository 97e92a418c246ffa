"""MoE routing against transformers' routers; expert parallel and MoE-TP splits
add up to the single-rank result."""

import pytest
import torch

from fleetserve.distributed.parallel_state import ParallelState
from fleetserve.layers.moe import RoutedExperts, select_experts

E, H, K = 8, 16, 2


def _dict_source(tensors):
    class Source:
        reads = []

        def has(self, n):
            return n in tensors

        def shape(self, n):
            return tuple(tensors[n].shape)

        def read(self, n, dim=None, start=None, end=None):
            self.reads.append(n)
            t = tensors[n]
            return t if dim is None else t.narrow(dim, start, end - start)

    return Source()


def _sorted(w, ids):
    order = ids.argsort(dim=-1)
    return w.gather(1, order), ids.gather(1, order)


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_v2_softmax_routing_matches_transformers(method):
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    cfg = DeepseekV2Config(hidden_size=H, n_routed_experts=E, num_experts_per_tok=K, topk_method=method, n_group=4,
                           topk_group=2, routed_scaling_factor=1.5, num_attention_heads=2)
    router = DeepseekV2TopkRouter(cfg)
    g = torch.Generator().manual_seed(0)
    router.weight.data = torch.randn(E, H, generator=g)
    x = torch.randn(64, H, generator=g)
    _, ref_w, ref_ids = router(x)
    w, ids = select_experts(x @ router.weight.T, K, "softmax", method, 4, 2, False, 1.5)
    rw, rids = _sorted(ref_w, ref_ids)
    ow, oids = _sorted(w, ids)
    assert torch.equal(oids, rids)
    torch.testing.assert_close(ow, rw)
    assert len({tuple(r) for r in oids.tolist()}) >= 6  # tokens really go to different experts


def test_v3_sigmoid_routing_matches_transformers_and_bias_selects_only():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = DeepseekV3Config(hidden_size=H, n_routed_experts=E, num_experts_per_tok=K, n_group=4, topk_group=2,
                           routed_scaling_factor=2.5, norm_topk_prob=True)
    router = DeepseekV3TopkRouter(cfg)
    g = torch.Generator().manual_seed(1)
    router.weight.data = torch.randn(E, H, generator=g)
    router.e_score_correction_bias.copy_(torch.randn(E, generator=g))
    x = torch.randn(64, H, generator=g)
    _, ref_w, ref_ids = router(x)
    logits = x @ router.weight.T
    w, ids = select_experts(logits, K, "sigmoid", "noaux_tc", 4, 2, True, 2.5, router.e_score_correction_bias)
    rw, rids = _sorted(ref_w, ref_ids)
    ow, oids = _sorted(w, ids)
    assert torch.equal(oids, rids)
    torch.testing.assert_close(ow, rw)
    # The bias changes which experts are chosen ...
    _, ids0 = select_experts(logits, K, "sigmoid", "noaux_tc", 4, 2, True, 2.5, torch.zeros(E))
    assert not torch.equal(_sorted(w, ids)[1], _sorted(w, ids0)[1])
    # ... but the weights are the unbiased sigmoid scores, normalised, times the scaling factor.
    s = logits.sigmoid().gather(1, ids)
    torch.testing.assert_close(w, s / s.sum(-1, keepdim=True) * 2.5)
    # Selected experts lie in at most topk_group = 2 groups of 2.
    assert all(len({e // 2 for e in row}) <= 2 for row in ids.tolist())


def _experts_tensors(g, inter=12):
    t = {}
    for e in range(E):
        t[f"x.{e}.gate_proj.weight"] = torch.randn(inter, H, generator=g) / 4
        t[f"x.{e}.up_proj.weight"] = torch.randn(inter, H, generator=g) / 4
        t[f"x.{e}.down_proj.weight"] = torch.randn(H, inter, generator=g) / 4
    return t


def _reference_moe(t, x, ids, w):
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[n, j])
            h = torch.nn.functional.silu(t[f"x.{e}.gate_proj.weight"] @ x[n]) * (t[f"x.{e}.up_proj.weight"] @ x[n])
            out[n] += w[n, j] * (t[f"x.{e}.down_proj.weight"] @ h)
    return out


def test_routed_experts_ep_and_moe_tp_partials_sum_to_full():
    g = torch.Generator().manual_seed(2)
    t = _experts_tensors(g)
    x = torch.randn(10, H, generator=g)
    ids = torch.randint(0, E, (10, K), generator=g)
    w = torch.rand(10, K, generator=g)
    ref = _reference_moe(t, x, ids, w)

    full = RoutedExperts(H, 12, E, "silu")
    full.load(_dict_source(t), "x")
    torch.testing.assert_close(full(x, ids, w), ref, atol=1e-5, rtol=1e-5)

    for layout in ("ep", "moe_tp"):
        parts = []
        for rank in range(2):
            ps = ParallelState(tp_rank=rank, tp_size=2, ep_rank=rank, ep_size=2) if layout == "ep" else \
                ParallelState(tp_rank=rank, tp_size=2, moe_tp_rank=rank, moe_tp_size=2)
            src = _dict_source(t)
            src.reads = []
            ex = RoutedExperts(H, 12, E, "silu", ps)
            ex.load(src, "x")
            if layout == "ep":  # the loader touched only this rank's experts
                assert {int(n.split(".")[1]) for n in src.reads} == set(range(rank * 4, rank * 4 + 4))
                assert ex.w13.shape == (4, 24, H)
            else:
                assert ex.w13.shape == (E, 12, H)
            parts.append(ex(x, ids, w))
        assert parts[0].abs().sum() > 0 and parts[1].abs().sum() > 0
        torch.testing.assert_close(parts[0] + parts[1], ref, atol=1e-5, rtol=1e-5)


def test_empty_batch():
    ex = RoutedExperts(H, 12, E, "silu")
    out = ex(torch.zeros(0, H), torch.zeros(0, K, dtype=torch.int64), torch.zeros(0, K))
    assert out.shape == (0, H)


def test_v2_group_limited_keeps_top_groups():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(50, E, generator=g) * 3
    _, ids = select_experts(logits, K, "softmax", "group_limited_greedy", 4, 1, False, 1.0)
    best_group = logits.softmax(-1).view(50, 4, 2).max(-1).values.argmax(-1)
    assert torch.equal(ids // 2, best_group[:, None].expand(50, K))


def test_fused_checkpoint_layout_loads_the_same_experts():
    """transformers >= 5 may store experts fused: gate_up_proj [E, 2I, H], down_proj [E, H, I]."""
    g = torch.Generator().manual_seed(4)
    t = _experts_tensors(g)
    fused = {
        "x.gate_up_proj": torch.stack([torch.cat([t[f"x.{e}.gate_proj.weight"], t[f"x.{e}.up_proj.weight"]])
                                       for e in range(E)]),
        "x.down_proj": torch.stack([t[f"x.{e}.down_proj.weight"] for e in range(E)]),
    }
    for ps in (ParallelState(), ParallelState(tp_rank=1, tp_size=2, ep_rank=1, ep_size=2),
               ParallelState(tp_rank=1, tp_size=2, moe_tp_rank=1, moe_tp_size=2)):
        a, b = RoutedExperts(H, 12, E, "silu", ps), RoutedExperts(H, 12, E, "silu", ps)
        a.load(_dict_source(t), "x")
        b.load(_dict_source(fused), "x")
        assert torch.equal(a.w13, b.w13) and torch.equal(a.w2, b.w2)
        assert a.w13.abs().sum() > 0
