"""--quantization under TP 2 (gloo): every rank quantizes its own shard.

fp16_weight: greedy tokens equal the single-rank engine's (fp16 rounding is per
element, so shards round like the whole). int8: the two ranks agree with each other,
but not with one rank: a row-parallel shard quantizes its half of the input with its
own activation scale, so TP 2 int8 is a (slightly) different computation from TP 1
int8, and on this tiny random model the greedy tokens differ. int8wo: equal to the single
rank's (row-parallel shards take the whole row's scale, all-reduced at start-up). bf16_linear:
equal to the single rank's here too (rounding to bf16 is per element; each row-parallel rank's
partial sum is rounded to bf16 before the all-reduce, a difference of one bf16 step that did not
change these tokens)."""

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


@pytest.mark.parametrize("mode", ["fp16_weight", "int8", "int8wo", "bf16_linear"])
def test_tp2_tokens_equal_single_rank(pool2, tiny_deepseek_v3_dir, mode):
    eng = build_rank_engine(0, tiny_deepseek_v3_dir, dtype="float32", max_total_tokens=512, quantization=mode)
    single = {rid: r["ids"] for rid, r in
              drive(eng, {0: [greedy_req(f"p{i}", p, N_NEW) for i, p in enumerate(PROMPTS)]})["reqs"].items()}
    per_rank = pool2.run(JOBS, "quant_tokens_job", tiny_deepseek_v3_dir, dict(tp_size=2), mode, PROMPTS, N_NEW,
                         timeout=120)
    assert per_rank[0] == per_rank[1], mode
    assert sorted(per_rank[0]) == sorted(single) and all(len(v) == N_NEW for v in per_rank[0].values())
    if mode in ("fp16_weight", "int8wo", "bf16_linear"):  # int8wo: the shards' weights are the whole's (all-reduced row maxima)
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


def test_smoothed_int8_tp2_same_factors_on_every_rank(pool2, tiny_llama_dir):
    """--quantization int8 on Llama (SmoothQuant folded into the RMSNorm weights) under TP 2 over
    gloo: both ranks fold the same factors (bit for bit: the maxima are MAX-all-reduced), the
    factors are TP 1's (to calibration-pass rounding), each rank's QKV shard is the matching rows
    of TP 1's smoothed QKV, and both ranks produce the same greedy tokens."""
    eng = build_rank_engine(0, tiny_llama_dir, dtype="float32", max_total_tokens=512, quantization="int8")
    from fleetserve.layers.norm import RMSNorm
    from quant_jobs import torch_dequantized_rows

    model = eng.runner.model
    norms1 = [m.weight.detach().clone() for m in model.modules() if isinstance(m, RMSNorm)]
    orig = [m._fs_unsmoothed_weight for m in model.modules() if isinstance(m, RMSNorm)]
    qkv1 = torch_dequantized_rows(model.layers[0].self_attn.qkv_proj._gemm)
    attn = model.layers[0].self_attn
    per_rank = pool2.run(JOBS, "smoothed_int8_job", tiny_llama_dir, dict(tp_size=2), PROMPTS, N_NEW, timeout=120)
    (n0, w0, t0), (n1, w1, t1) = per_rank[0], per_rank[1]
    assert len(n0) == len(norms1) == 2 * len(model.layers) + 1
    for a, b, c, o in zip(n0, n1, norms1, orig):
        assert torch.equal(a, b)  # identical factors on both ranks
        assert torch.allclose(a, c, rtol=1e-4, atol=0)  # and TP 1's
        assert not torch.allclose(a, o, rtol=1e-3)  # really smoothed
    # TP 2 rank r holds query heads [2r, 2r+2) and KV head r of the 4 / 2: its rows of TP 1's [q; k; v]
    # (V rows too: the O-projection factors of kv head r come from the same two query heads on both)
    hd, q = attn.head_dim, attn.q_size
    for r, w in enumerate((w0, w1)):
        rows = torch.cat([torch.arange(r * q // 2, (r + 1) * q // 2), q + torch.arange(r * hd, (r + 1) * hd),
                          q + 2 * hd + torch.arange(r * hd, (r + 1) * hd)])
        assert w.shape == (q // 2 + 2 * hd, qkv1.shape[1])
        assert torch.allclose(w, qkv1[rows], rtol=1e-3, atol=1e-3 * qkv1.abs().max().item()), r
    assert t0 == t1 and all(len(v) == N_NEW for v in t0.values())
