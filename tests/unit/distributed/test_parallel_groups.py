"""Rank layout, validation messages and real group construction over gloo."""

import pytest
import torch
import torch.distributed as dist

from fleetserve.testing import rank_pool

from fleetserve.distributed.groups import (ModelShape, ParallelConfig, ParallelConfigError, build_parallel_state,
                                         rank_layout, validate)

V3 = ModelShape("DeepseekV3ForCausalLM", num_attention_heads=8, num_key_value_heads=8, is_mla=True,
                n_routed_experts=8, moe_intermediate_size=32, intermediate_size=64)
LLAMA = ModelShape("LlamaForCausalLM", num_attention_heads=9, num_key_value_heads=3, is_mla=False,
                   intermediate_size=1536)


@pytest.mark.parametrize("cfg, model, needle", [
    (ParallelConfig(tp_size=3, dp_size=2, enable_dp_attention=True), None, "divisible by --dp-size"),
    (ParallelConfig(tp_size=4, ep_size=3), None, "--ep-size 3 must divide --tp-size 4"),
    (ParallelConfig(tp_size=2, moe_a2a_backend="all_to_all"), None, "needs --ep-size > 1"),
    (ParallelConfig(tp_size=4, ep_size=2, moe_a2a_backend="all_to_all"), None, "equal to --tp-size"),
    (ParallelConfig(tp_size=2, moe_a2a_backend="deepep"), None, "--moe-a2a-backend must be one of"),
    (ParallelConfig(tp_size=3, nnodes=2), None, "--nnodes 2"),
    (ParallelConfig(tp_size=4, ep_size=4), ModelShape("DeepseekV3ForCausalLM", 8, 8, True, 6, 32, 64),
     "6 routed experts, not divisible by --ep-size 4"),
    (ParallelConfig(tp_size=2), LLAMA, "9 attention heads"),
    (ParallelConfig(tp_size=9), LLAMA, "3 KV heads"),
    (ParallelConfig(tp_size=2, dp_size=2, enable_dp_attention=True),
     ModelShape("LlamaForCausalLM", 8, 8, False, intermediate_size=64), "MLA models"),
    (ParallelConfig(tp_size=2, ep_size=2), ModelShape("LlamaForCausalLM", 8, 8, False, intermediate_size=64),
     "needs a MoE model"),
    (ParallelConfig(tp_size=4, ep_size=2), ModelShape("DeepseekV3ForCausalLM", 8, 8, True, 8, 33, 64),
     "expert intermediate size 33"),
])
def test_impossible_combinations_are_refused_with_the_flags_named(cfg, model, needle):
    with pytest.raises(ParallelConfigError, match=needle.replace("(", r"\(").replace("+", r"\+")):
        validate(cfg, model)


def test_valid_layouts_pass_validation():
    for cfg in [ParallelConfig(tp_size=2), ParallelConfig(tp_size=2, dp_size=2, enable_dp_attention=True),
                ParallelConfig(tp_size=2, dp_size=2, enable_dp_attention=True, ep_size=2,
                               moe_a2a_backend="all_to_all"),
                ParallelConfig(tp_size=4, dp_size=2, enable_dp_attention=True, ep_size=2)]:
        validate(cfg, V3)
    validate(ParallelConfig(tp_size=3), LLAMA)  # 9 heads, 3 KV heads, 1536 wide: fits 3 ranks


def test_rank_layout_arithmetic_for_four_ranks():
    cfg = ParallelConfig(tp_size=4, dp_size=2, enable_dp_attention=True, ep_size=2)
    assert (cfg.attn_tp_size, cfg.attn_dp_size, cfg.moe_tp_size, cfg.world_size) == (2, 2, 2, 4)
    lay = [rank_layout(cfg, r) for r in range(4)]
    assert [(x.attn_dp_rank, x.attn_tp_rank) for x in lay] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [(x.ep_rank, x.moe_tp_rank) for x in lay] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert lay[2].attn_tp_ranks == (2, 3) and lay[2].attn_dp_ranks == (0, 2)
    assert lay[3].ep_ranks == (1, 3) and lay[3].moe_tp_ranks == (2, 3)
    # Without DP attention, dp_size means replicas: 2 x 4 ranks.
    assert ParallelConfig(tp_size=4, dp_size=2).world_size == 8


LAYOUTS_2 = [
    ("tp2", dict(tp_size=2)),
    ("dp2_attn", dict(tp_size=2, dp_size=2, enable_dp_attention=True)),
    ("dp2_attn_ep2", dict(tp_size=2, dp_size=2, enable_dp_attention=True, ep_size=2)),
    ("tp2_ep2", dict(tp_size=2, ep_size=2, moe_a2a_backend="all_to_all")),
]
LAYOUTS_4 = [
    ("tp4_dp2_ep2", dict(tp_size=4, dp_size=2, enable_dp_attention=True, ep_size=2)),
    ("tp4_dp4_ep4", dict(tp_size=4, dp_size=4, enable_dp_attention=True, ep_size=4, moe_a2a_backend="all_to_all")),
    ("tp4_ep2", dict(tp_size=4, ep_size=2)),
]


def _members(group, size):
    """The tp ranks in ``group`` as every member sees them (all_gather of tp_rank)."""
    if size == 1:
        return [dist.get_rank()]
    parts = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    dist.all_gather(parts, torch.tensor([dist.get_rank()]), group=group)
    return [int(p) for p in parts]


def groups_job(rank, world, layouts):
    out = {}
    for name, kw in layouts:
        cfg = ParallelConfig(**kw)
        ps = build_parallel_state(cfg, rank, timeout_s=rank_pool.TIMEOUT_S)
        out[name] = dict(
            tp=_members(ps.tp_group, ps.tp_size), attn_tp=_members(ps.attn_tp_group, ps.attn_tp_size),
            attn_dp=_members(ps.attn_dp_group, ps.attn_dp_size), ep=_members(ps.ep_group, ps.ep_size),
            moe_tp=_members(ps.moe_tp_group, ps.moe_tp_size), cpu=_members(ps.cpu_group, ps.tp_size),
            ranks=(ps.attn_dp_rank, ps.attn_tp_rank, ps.ep_rank, ps.moe_tp_rank),
        )
    return out


def _expected(kw, rank):
    cfg = ParallelConfig(**kw)
    lay = rank_layout(cfg, rank)
    return dict(tp=list(range(cfg.tp_size)), attn_tp=list(lay.attn_tp_ranks), attn_dp=list(lay.attn_dp_ranks),
                ep=list(lay.ep_ranks), moe_tp=list(lay.moe_tp_ranks), cpu=list(range(cfg.tp_size)),
                ranks=(lay.attn_dp_rank, lay.attn_tp_rank, lay.ep_rank, lay.moe_tp_rank))


def test_groups_over_two_ranks_have_the_right_members(pool2):
    got = pool2.run(__file__, "groups_job", LAYOUTS_2)
    for rank, per in enumerate(got):
        for name, kw in LAYOUTS_2:
            assert per[name] == _expected(kw, rank), (name, rank)
    # spot checks in plain words
    assert got[1]["dp2_attn"]["ranks"][:2] == (1, 0)       # rank 1 is attention group 1
    assert got[0]["tp2"]["attn_tp"] == [0, 1]              # TP: heads split over both


def test_groups_over_four_ranks_have_the_right_members(pool4):
    got = pool4.run(__file__, "groups_job", LAYOUTS_4)
    for rank, per in enumerate(got):
        for name, kw in LAYOUTS_4:
            assert per[name] == _expected(kw, rank), (name, rank)
    assert got[3]["tp4_dp2_ep2"]["ep"] == [1, 3] and got[3]["tp4_dp2_ep2"]["attn_dp"] == [1, 3]
    assert got[2]["tp4_ep2"]["moe_tp"] == [2, 3]
