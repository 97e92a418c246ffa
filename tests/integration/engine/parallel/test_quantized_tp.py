"""--quantization under TP 2 (gloo): every rank quantizes its own shard.

fp16_weight: greedy tokens equal the single-rank engine's (fp16 rounding is per
element, so shards round like the whole). int8: the two ranks agree with each other,
but not with one rank: a row-parallel shard quantizes its half of the input with its
own activation scale, so TP 2 int8 is a (slightly) different computation from TP 1
int8, and on this tiny random model the greedy tokens differ. int8wo: equal to the single
rank's (row-parallel shards take the whole row's scale, all-reduced at start-up)."""

import os
import sys

import pytest
import torch

from fleetserve.layers.quantization import fbgemm_available
from fleetserve.testing.rank_engine import build_rank_engine, drive

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from parallel_jobs import greedy_req  # noqa: E402

JOBS = os.path.join(HERE, "quant_jobs.py")
PROMPTS = [[256, 72, 101, 108, 108], [256, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [256] + list(range(30, 47))]
N_NEW = 8

pytestmark = pytest.mark.skipif(not fbgemm_available(), reason="no fbgemm kernels on this CPU")


@pytest.mark.parametrize("mode", ["fp16_weight", "int8", "int8wo"])
def test_tp2_tokens_equal_single_rank(pool2, tiny_deepseek_v3_dir, mode):
    eng = build_rank_engine(0, tiny_deepseek_v3_dir, dtype="float32", max_total_tokens=512, quantization=mode)
    single = {rid: r["ids"] for rid, r in
              drive(eng, {0: [greedy_req(f"p{i}", p, N_NEW) for i, p in enumerate(PROMPTS)]})["reqs"].items()}
    per_rank = pool2.run(JOBS, "quant_tokens_job", tiny_deepseek_v3_dir, dict(tp_size=2), mode, PROMPTS, N_NEW,
                         timeout=120)
    assert per_rank[0] == per_rank[1], mode
    assert sorted(per_rank[0]) == sorted(single) and all(len(v) == N_NEW for v in per_rank[0].values())
    if mode in ("fp16_weight", "int8wo"):  # int8wo: the shards' weights are the whole's (all-reduced row maxima)
        assert per_rank[0] == single


@pytest.mark.parametrize("mode", ["int8wo", "int4wo-32"])
def test_weight_only_tp2_shards_are_the_unsharded_quantized_weights(pool2, mode):
    """TP 2 over gloo: the shards' quantized weights, put together, equal the TP 1 quantized
    weights bit for bit (int8wo all-reduces the row maxima of row-parallel shards; int4wo
    shards are whole groups), and the all-reduced outputs equal TP 1's to float rounding."""
    from quant_jobs import weight_only_shards_job

    single = weight_only_shards_job(0, 1, mode, 5)
    per_rank = pool2.run(JOBS, "weight_only_shards_job", mode, 5, timeout=120)
    assert torch.equal(torch.cat([per_rank[0][0], per_rank[1][0]]), single[0])
    assert torch.equal(torch.cat([per_rank[0][1], per_rank[1][1]], dim=1), single[1])
    assert torch.allclose(torch.cat([per_rank[0][2], per_rank[1][2]], -1), single[2], atol=1e-6, rtol=0)
    for r in range(2):
        assert torch.allclose(per_rank[r][3], single[3], atol=1e-5, rtol=0)
    if mode == "int8wo":  # a shard's own row maxima would give other scales: the all-reduce matters
        from fleetserve.layers.weight_only import quantize_int8_rows

        own = quantize_int8_rows(single[1][:, :64])[1]
        assert not torch.equal(own, quantize_int8_rows(single[1])[1])
