"""--quantization int8wo / int4wo-<g>: weight-only linears against float32 with bounds from
the quantization step, sharding (in one process), flag errors."""

import argparse

import pytest
import torch

from fleetserve.engine.args import ServerArgs
from fleetserve.layers.linear import ColumnParallelLinear, ParallelLMHead, RowParallelLinear, TPGroup
from fleetserve.layers.quantization import QUANTIZATION_CHOICES, apply_quantization, resolve_quantization
from fleetserve.layers.weight_only import (Int4WeightOnlyGemm, Int8WeightOnlyGemm, quantize_int4_groups,
                                           quantize_int8_rows)
from helpers.weight_source import DictSource

SHAPES = [(576, 960), (576, 576), (1536, 576), (64, 40)]  # (in, out): SmolLM2's, and one with out % 16 != 0


def step_bound(x: torch.Tensor, step: torch.Tensor, group: int) -> torch.Tensor:
    """Worst case ``|y - x @ W.T|`` per output when every weight is off by at most ``step / 2``:
    ``sum_i |x_i| * step[o, i // group] / 2`` ([rows, out]). ``step``: [out, in / group]."""
    per_col = step.repeat_interleave(group, dim=1) / 2  # [out, in]
    return x.abs() @ per_col.T


@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("rows", [1, 7])
def test_int8wo_within_half_step(k, n, rows):
    g = torch.Generator().manual_seed(k * n + rows)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    x = torch.randn(rows, k, generator=g)
    gemm = Int8WeightOnlyGemm(w)
    ref, y = x @ w.T, gemm(x)
    step = (w.abs().amax(1) / 127)[:, None]
    err = (y - ref).abs()
    assert (err <= step_bound(x, step, k) * 1.0001 + 1e-5).all()
    assert (gemm.dequantized() - w).abs().max() <= step.max() / 2 * 1.0001
    assert ((y - x @ gemm.dequantized().T).abs() <= 1e-4 * ref.abs().max()).all()  # same product, other order
    rel = ((y - ref).norm() / ref.norm()).item()
    assert 1e-4 < rel < 0.01, rel  # really quantized: per-row int8 on Gaussians gives ~0.5%


@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("rows", [5, 20])  # the aten int4 kernel, and the dequantized path (>= INT4_DEQUANT_ROWS)
def test_int4wo_within_half_step(k, n, group, rows):
    g = torch.Generator().manual_seed(k + n + group)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    x = torch.randn(rows, k, generator=g)
    gemm = Int4WeightOnlyGemm(w, group)
    wg = w.reshape(n, k // group, group)
    step = (wg.amax(-1) - wg.amin(-1)) / 15
    ref, y = x @ w.T, gemm(x)
    assert y.shape == (rows, n)
    assert ((y - ref).abs() <= step_bound(x, step, group) * 1.0001 + 1e-5).all()
    assert ((gemm.dequantized() - w).abs() <= step.repeat_interleave(group, 1) / 2 * 1.0001 + 1e-7).all()
    assert ((y - x @ gemm.dequantized().T).abs() <= 1e-4 * ref.abs().max()).all()  # aten kernel = our dequant
    rel = ((y - ref).norm() / ref.norm()).item()
    assert 0.01 < rel < 0.15, rel  # 4 bits per group of 32 on Gaussians: ~8%


def test_quantizers_edges():
    w = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, -2.0, 0.5, 2.0]])
    q, s = quantize_int8_rows(w)
    assert s.tolist() == [1.0, pytest.approx(2 / 127)] and q[0].tolist() == [0, 0, 0, 0]
    assert q[1].tolist() == [64, -127, 32, 127]
    q4, sc, lo = quantize_int4_groups(torch.tensor([[3.0] * 4, [0.0, 1.5, 0.8, 0.1]]), 4)
    assert q4[0].tolist() == [0, 0, 0, 0] and sc[0].item() == 1.0 and lo[0].item() == 3.0
    assert q4[1].tolist() == [0, 15, 8, 1] and sc[1].item() == pytest.approx(0.1) and lo[1].item() == 0.0
    with pytest.raises(ValueError, match=r"^--quantization int4wo-32: a linear has 48 input features"):
        quantize_int4_groups(torch.zeros(16, 48), 32)


def test_gemm_shapes_bias_dtype_and_empty():
    w, b = torch.randn(16, 64), torch.randn(16)
    x = torch.randn(2, 3, 64)
    for gemm in (Int8WeightOnlyGemm(w), Int4WeightOnlyGemm(w, 32)):
        y = gemm(x, w, b)
        assert y.shape == (2, 3, 16) and y.dtype == torch.float32
        assert torch.allclose(y, x @ gemm.dequantized().T + b, atol=1e-4)
        assert gemm(torch.randn(0, 64)).shape == (0, 16)
        assert gemm(x.bfloat16()).dtype == torch.bfloat16


@pytest.mark.parametrize("mode", ["int8wo", "int4wo-32"])
def test_column_shards_equal_unsharded_rows(mode):
    """Column shards hold whole rows: their quantized weights are the unsharded ones' rows, bit for bit."""
    g = torch.Generator().manual_seed(2)
    src = DictSource(up=torch.randn(96, 64, generator=g) / 8)
    x = torch.randn(3, 64, generator=g)

    def col(rank, size):
        m = ColumnParallelLinear(64, [96], tp=TPGroup(rank, size))
        m.load(src, "up")
        assert apply_quantization(torch.nn.ModuleList([m]), mode) == mode
        return m

    full = col(0, 1)
    parts = [col(r, 2) for r in range(2)]
    assert torch.equal(torch.cat([p._gemm.dequantized() for p in parts]), full._gemm.dequantized())
    with torch.inference_mode():
        assert torch.allclose(torch.cat([p(x) for p in parts], -1), full(x), atol=1e-6, rtol=0)


def test_int4_row_shards_are_whole_groups():
    g = torch.Generator().manual_seed(3)
    src = DictSource(down=torch.randn(48, 128, generator=g) / 11)
    shards = []
    for r, size in [(0, 1), (0, 2), (1, 2)]:
        m = RowParallelLinear(128, 48, tp=TPGroup(r, size), reduce_results=False)
        m.load(src, "down")
        apply_quantization(torch.nn.ModuleList([m]), "int4wo-64")
        shards.append(m._gemm.dequantized())
    assert torch.equal(torch.cat(shards[1:], dim=1), shards[0])
    m = RowParallelLinear(96, 48, tp=TPGroup(0, 2), reduce_results=False)  # 48 columns per rank
    with pytest.raises(ValueError, match=r"^--quantization int4wo-32: a linear has 48 input features \(per rank\)"):
        apply_quantization(torch.nn.ModuleList([m]), "int4wo-32")


def test_lm_head_int8wo_and_float_under_int4wo():
    from fleetserve.layers.linear import VocabParallelEmbedding

    emb = VocabParallelEmbedding(50, 64)
    emb.weight.data.normal_()
    head = ParallelLMHead(50, 64, tied_to=emb)
    model = torch.nn.ModuleList([emb, head])
    before = head._gemm
    apply_quantization(model, "int4wo-32")
    assert head._gemm is before  # the LM head stays float32 under int4wo
    apply_quantization(model, "int8wo")
    assert isinstance(head._gemm, Int8WeightOnlyGemm)
    h = torch.randn(4, 64)
    with torch.inference_mode():
        assert torch.equal(emb(torch.tensor([1, 2])), emb.weight[[1, 2]])  # embedding untouched
        assert torch.allclose(head(h), h @ head._gemm.dequantized().T, atol=1e-4)


def test_names_and_errors():
    # SGLang's --torchao-config spellings (python/sglang/srt/layers/torchao_utils.py): int8wo, int4wo-<g>,
    # g in [32, 64, 128, 256].
    for name in ("int8wo", "int4wo-32", "int4wo-64", "int4wo-128", "int4wo-256"):
        assert name in QUANTIZATION_CHOICES and resolve_quantization(name) == name
    with pytest.raises(ValueError, match=r"^--quantization must be one of .*'int4wo-16'"):
        resolve_quantization("int4wo-16")
    with pytest.raises(ValueError, match=r"^--quantization int8wo runs on CPU only"):
        resolve_quantization("int8wo", "cuda:0")
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    assert ServerArgs.from_cli_args(parser.parse_args(["--quantization", "int4wo-128"])).quantization == "int4wo-128"
    for kwargs, msg in [(dict(quantization="int4wo"), "--quantization must be one of"),
                        (dict(quantization="int8_weight_only"), "--quantization must be one of"),
                        (dict(quantization="int4wo-32", device="cuda"), "--quantization int4wo-32 runs on CPU only")]:
        with pytest.raises(ValueError) as e:
            ServerArgs(**kwargs)
        assert str(e.value).startswith(msg) and "\n" not in str(e.value)
