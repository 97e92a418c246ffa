"""layers/fbgemm_calls.py: the cheaper call paths give the quantized ops' results bit for bit."""

import pytest
import torch

from fleetserve.layers.fbgemm_calls import ATEN_FP16, LINEAR_DYNAMIC_INT8, PackedFp16
from fleetserve.layers.quantization import Fp16WeightGemm, fbgemm_available, quantize_weight_per_row

pytestmark = pytest.mark.skipif(not fbgemm_available(), reason="no fbgemm kernels on this CPU")


@pytest.mark.parametrize("rows", [1, 3, 8, 33])
@pytest.mark.parametrize("out_f,in_f", [(960, 576), (576, 1536), (100, 24)])
def test_packed_fp16_equals_quantized_op(rows, out_f, in_f):
    g = torch.Generator().manual_seed(rows * 7 + out_f)
    w = torch.randn(out_f, in_f, generator=g) / in_f ** 0.5
    x = torch.randn(rows, in_f, generator=g)
    ref = torch.ops.quantized.linear_dynamic_fp16(x, torch.ops.quantized.linear_prepack_fp16(w, None))
    got = PackedFp16(w)(x)
    assert got.shape == (rows, out_f) and got.dtype == torch.float32
    assert torch.equal(got, ref)
    # it is really fp16 weights, not float32 ones
    assert not torch.equal(got, x @ w.T)
    assert torch.equal(Fp16WeightGemm(w)(x), ref)
    b = torch.randn(out_f, generator=g)
    assert torch.equal(Fp16WeightGemm(w)(x, None, b), ref + b)


def test_aten_pair_is_what_runs_here():
    # this project's CPU machines (torch 2.13 + fbgemm) have aten's pair; a build without it falls back
    assert ATEN_FP16
    assert PackedFp16(torch.eye(4)).zero_bias.tolist() == [0.0] * 4


def test_int8_default_overload_equals_packet():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 32, generator=g)
    x = torch.randn(5, 32, generator=g)
    packed = torch.ops.quantized.linear_prepack(quantize_weight_per_row(w), None)
    assert torch.equal(LINEAR_DYNAMIC_INT8(x, packed, True), torch.ops.quantized.linear_dynamic(x, packed, True))
