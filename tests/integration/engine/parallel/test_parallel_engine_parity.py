"""Multi-rank engine == single-rank engine == transformers (greedy tokens and fp32 logits).

Each layout runs the real scheduler + model runner on every rank of a gloo
pool, with tiny random DeepSeek-V2 / V3 models. Logits are the rows that chose
each greedy token; they must be within 1e-3 of transformers' and of our
single-rank engine's.
"""

import os
import sys

import pytest
import torch

from fleetserve.testing.rank_engine import build_rank_engine, drive

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from parallel_jobs import greedy_req, hf_greedy  # noqa: E402

JOBS = os.path.join(HERE, "parallel_jobs.py")
PROMPTS = [[256, 72, 101, 108, 108], [256, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11],
           [256, 200, 13, 77, 42, 5, 9], [256] + list(range(30, 47))]
N_NEW = 10
ATOL = 1e-3

V3_LAYOUTS = {
    "tp2": dict(tp_size=2),
    "dp2_attn": dict(tp_size=2, dp_size=2, enable_dp_attention=True),
    "dp2_attn_ep2_allgather": dict(tp_size=2, dp_size=2, enable_dp_attention=True, ep_size=2),
    "dp2_attn_ep2_all_to_all": dict(tp_size=2, dp_size=2, enable_dp_attention=True, ep_size=2,
                                    moe_a2a_backend="all_to_all"),
    "tp2_ep2_allgather": dict(tp_size=2, ep_size=2),
    "tp2_ep2_all_to_all": dict(tp_size=2, ep_size=2, moe_a2a_backend="all_to_all"),
}
V2_LAYOUTS = {
    "tp2": dict(tp_size=2),
    # --page-size 16 under DP attention: each attention group its own paged pool and radix tree
    "dp2_attn_page16": dict(tp_size=2, dp_size=2, enable_dp_attention=True, page_size=16),
    "dp2_attn_ep2_all_to_all": dict(tp_size=2, dp_size=2, enable_dp_attention=True, ep_size=2,
                                    moe_a2a_backend="all_to_all"),
}
FOUR_RANK_LAYOUTS = {
    # two attention groups of two ranks; experts over 2 ranks, each expert split over 2
    "tp4_dp2_attn_ep2": dict(tp_size=4, dp_size=2, enable_dp_attention=True, ep_size=2),
    # every rank its own attention group; every rank a quarter of the experts, all_to_all
    "tp4_dp4_attn_ep4_all_to_all": dict(tp_size=4, dp_size=4, enable_dp_attention=True, ep_size=4,
                                        moe_a2a_backend="all_to_all"),
}


def single_rank(model_dir):
    eng = build_rank_engine(0, model_dir, dtype="float32", max_total_tokens=512)
    out = drive(eng, {0: [greedy_req(f"p{i}", p, N_NEW) for i, p in enumerate(PROMPTS)]}, record_logits=True)
    return {rid: (r["ids"], torch.stack(r["logits"])) for rid, r in out["reqs"].items()}


@pytest.fixture(scope="module")
def refs(tiny_deepseek_v3_dir, tiny_deepseek_v2_dir):
    out = {}
    for name, d in (("v3", tiny_deepseek_v3_dir), ("v2", tiny_deepseek_v2_dir)):
        hf = hf_greedy(d, PROMPTS, N_NEW)
        out[name] = (d, {f"p{i}": hf[i] for i in range(len(PROMPTS))}, single_rank(d))
    return out


def test_single_rank_engine_matches_transformers(refs):
    for name, (_, hf, single) in refs.items():
        for rid, (ids, logits) in hf.items():
            assert single[rid][0] == ids, (name, rid)
            assert (single[rid][1] - logits).abs().max().item() <= ATOL, (name, rid)


def _check_layout(pool, name, model, sizes, refs):
    model_dir, hf, single = refs[model]
    per_rank = pool.run(JOBS, "parity_job", model_dir, sizes, PROMPTS, N_NEW, timeout=120)
    seen = {}
    for rank_out in per_rank:
        for rid, (ids, rows) in rank_out.items():
            rows = torch.stack(rows)
            if rid in seen:  # ranks of one attention group must agree exactly
                assert seen[rid][0] == ids and torch.equal(seen[rid][1], rows), (name, rid)
            seen[rid] = (ids, rows)
    assert sorted(seen) == sorted(hf), name
    worst = 0.0
    for rid, (ids, rows) in seen.items():
        assert ids == hf[rid][0], f"{name} {rid}: tokens differ from transformers"
        assert ids == single[rid][0], f"{name} {rid}: tokens differ from the single-rank engine"
        worst = max(worst, (rows - hf[rid][1]).abs().max().item(), (rows - single[rid][1]).abs().max().item())
    assert worst <= ATOL, f"{name}: max abs logit diff {worst:.2e}"
    return worst


@pytest.mark.parametrize("layout", sorted(V3_LAYOUTS))
def test_two_rank_layouts_deepseek_v3(pool2, refs, layout):
    _check_layout(pool2, layout, "v3", V3_LAYOUTS[layout], refs)


@pytest.mark.parametrize("layout", sorted(V2_LAYOUTS))
def test_two_rank_layouts_deepseek_v2(pool2, refs, layout):
    _check_layout(pool2, layout, "v2", V2_LAYOUTS[layout], refs)


@pytest.mark.parametrize("layout", sorted(FOUR_RANK_LAYOUTS))
def test_four_rank_layouts_deepseek_v3(pool4, refs, layout):
    _check_layout(pool4, layout, "v3", FOUR_RANK_LAYOUTS[layout], refs)
