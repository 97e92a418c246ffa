"""--quantization: int8 (fbgemm W8A8) and fp16_weight linears against float32,
per-shard quantization under TP, mode resolution and flag errors."""

import argparse

import pytest
import torch

from fleetserve.engine.args import ServerArgs
from fleetserve.layers.linear import ColumnParallelLinear, ParallelLMHead
from fleetserve.layers.quantization import (Fp16WeightGemm, Int8DynamicGemm, activation_grid, apply_quantization,
                                            fbgemm_available, has_vnni, quantize_weight_per_row, resolve_quantization)
from helpers.weight_source import DictSource, column_row_pair

pytestmark = pytest.mark.skipif(not fbgemm_available(), reason="no fbgemm kernels on this CPU")

#: Relative error bounds ||y - y32|| / ||y32|| on Gaussian weights and inputs. int8: 7-bit
#: activations x 8-bit weights give ~2% (measured 1.8-2.3%); fp16 weights give ~2e-4.
INT8_REL = 0.04
FP16_REL = 1e-3
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # SmolLM2-135M's linears


def rel(y, ref):
    return ((y - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("rows", [1, 32])
def test_gemms_close_to_float32(k, n, rows):
    g = torch.Generator().manual_seed(k + n + rows)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    x = torch.randn(rows, k, generator=g)
    ref = x @ w.T
    e8 = rel(Int8DynamicGemm(w)(x), ref)
    e16 = rel(Fp16WeightGemm(w)(x), ref)
    assert 1e-4 < e8 <= INT8_REL, e8  # lower bound: it really is quantized
    assert e16 <= FP16_REL, e16


def test_activation_grid_is_fbgemms_choice_for_minus_one_to_one():
    # ChooseQuantizationParams on [-1, 1]: scale (max - min) / qmax, zero point round(-min / scale)
    assert activation_grid(True) == pytest.approx((2 / 127, 64)) and activation_grid(False) == pytest.approx((2 / 255, 128))


@pytest.mark.parametrize("rows", [1, 7, 32])
def test_residual_passes_shrink_the_error(rows):
    """Two-term activations leave only the weight's int8 rounding (~100x less activation error,
    outlier channel and outlier token included); two-term weights too bring it near fp16's.
    The machine's own activation width (7 bits without VNNI: 8 would saturate fbgemm's AVX2 int16 sums)."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 80, generator=g) / 9
    x = torch.randn(rows, 80, generator=g)
    x[:, 5] *= 40  # an outlier channel
    x[0] *= 30  # an outlier token
    ref, ref_wq = x @ w.T, x @ quantize_weight_per_row(w).dequantize().T
    one = Int8DynamicGemm(w)
    two = Int8DynamicGemm(w, act_passes=2)
    both = Int8DynamicGemm(w, act_passes=2, weight_passes=2)
    e1, e2 = rel(one(x), ref_wq), rel(two(x), ref_wq)
    assert e1 > 5e-3 and e2 < 2e-3 and e2 < e1 / 20, (e1, e2)
    assert 1e-3 < rel(two(x), ref) < 2e-2  # what is left: the 8-bit weight (~0.8%)
    assert rel(both(x), ref) < 2e-3
    y = both(x.bfloat16().view(1, rows, 80), w, torch.ones(96))
    assert y.shape == (1, rows, 96) and y.dtype == torch.bfloat16 and both(torch.randn(0, 80)).shape == (0, 96)


def test_residual_pass_arguments():
    w = torch.randn(8, 8)
    with pytest.raises(ValueError, match="act_passes and weight_passes must be 1 or 2"):
        Int8DynamicGemm(w, act_passes=3)
    with pytest.raises(ValueError, match="weight_passes=2 needs act_passes=2"):
        Int8DynamicGemm(w, weight_passes=2)


def test_gemm_shapes_bias_and_dtype():
    w, b = torch.randn(16, 8), torch.randn(16)
    x = torch.randn(2, 3, 8)
    for gemm in (Int8DynamicGemm(w), Fp16WeightGemm(w)):
        y = gemm(x, w, b)
        assert y.shape == (2, 3, 16) and y.dtype == torch.float32
        assert rel(y, x @ w.T + b) <= INT8_REL
        assert gemm(torch.randn(0, 8)).shape == (0, 16)
        assert gemm(x.bfloat16()).dtype == torch.bfloat16


def test_vnni_detection_decides_reduce_range():
    assert has_vnni({"avx2", "avx512_vnni"}) and has_vnni({"avx_vnni"}) and not has_vnni({"avx2", "fma"})


@pytest.mark.parametrize("mode", ["int8", "fp16_weight"])
def test_tp_shards_quantize_per_shard(mode):
    """Column shards of a quantized layer equal the matching columns of the unsharded
    quantized layer exactly (per-row weight scales, same activation scale); the row-parallel
    partial sums recombine to within the bound."""
    g = torch.Generator().manual_seed(1)
    up, down = torch.randn(64, 48, generator=g) / 7, torch.randn(48, 64, generator=g) / 8
    x = torch.randn(5, 48, generator=g)
    src = DictSource(up=up, down=down)

    def build(rank, size):
        col, row = column_row_pair(src, rank, size, mode)
        assert all(not hasattr(m._gemm, "_key") for m in (col, row))  # swapped off the float path
        return col, row

    full_col, full_row = build(0, 1)
    with torch.inference_mode():
        y_full = full_col(x)
        parts, row_sum = [], 0
        for r in range(2):
            col, row = build(r, 2)
            y = col(x)
            parts.append(y)
            row_sum = row_sum + row(y_full[:, r * 32:(r + 1) * 32])
        assert torch.equal(torch.cat(parts, -1), y_full)
        assert rel(row_sum, full_row(y_full)) <= INT8_REL
        assert rel(row_sum, y_full @ down.T) <= 2 * INT8_REL


def test_lm_head_tied_keeps_embedding_float():
    from fleetserve.layers.linear import VocabParallelEmbedding

    emb = VocabParallelEmbedding(50, 16)
    emb.weight.data.normal_()
    head = ParallelLMHead(50, 16, tied_to=emb)
    model = torch.nn.ModuleList([emb, head])
    table = emb.weight.detach().clone()
    apply_quantization(model, "int8")
    h = torch.randn(4, 16)
    with torch.inference_mode():
        assert torch.equal(emb(torch.tensor([1, 2])), table[[1, 2]])
        assert rel(head(h), h @ table.T) <= INT8_REL


def test_mode_resolution_and_errors():
    assert resolve_quantization("none") == "none" and resolve_quantization(None) == "none"
    assert resolve_quantization("int8") == resolve_quantization("w8a8_int8") == "int8"
    assert resolve_quantization("auto", "cpu") == "fp16_weight"
    assert resolve_quantization("auto", "cuda:0") == "none"
    with pytest.raises(ValueError, match=r"^--quantization int8 runs on CPU only"):
        resolve_quantization("int8", "cuda")
    with pytest.raises(ValueError, match=r"^--quantization must be one of .*'int4'"):
        resolve_quantization("int4")


def test_server_args_flags():
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    a = ServerArgs.from_cli_args(parser.parse_args(["--quantization", "int8", "--torch-num-threads", "3"]))
    assert a.quantization == "int8" and a.torch_num_threads == 3
    d = ServerArgs.from_cli_args(parser.parse_args([]))
    assert d.quantization == "none" and d.torch_num_threads is None
    for kwargs, msg in [(dict(quantization="int4"), "--quantization must be one of"),
                        (dict(quantization="int8", device="cuda"), "--quantization int8 runs on CPU only"),
                        (dict(torch_num_threads=0), "--torch-num-threads must be >= 1")]:
        with pytest.raises(ValueError) as e:
            ServerArgs(**kwargs)
        assert str(e.value).startswith(msg) and "\n" not in str(e.value)


def test_apply_quantization_passes_reach_the_linears():
    """The benchmark-only ``int8-res`` variant (``benchmarks/quant_modes.py``): two-term int8
    activations and weights through :func:`apply_quantization` come within fp16-like error."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 48, generator=g) / 7
    col = ColumnParallelLinear(48, [64])
    col.load(DictSource(w=w), "w")
    x = torch.randn(5, 48, generator=g)
    with torch.inference_mode():
        assert apply_quantization(torch.nn.ModuleList([col]), "int8") == "int8"
        e1 = rel(col(x), x @ w.T)
        assert apply_quantization(torch.nn.ModuleList([col]), "int8", act_passes=2, weight_passes=2) == "int8"
        e2 = rel(col(x), x @ w.T)
    assert e1 > 5e-3 and e2 < 2e-3, (e1, e2)
