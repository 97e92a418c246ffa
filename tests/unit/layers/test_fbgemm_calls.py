"""layers/fbgemm_calls.py: the resolved quantized ops give the packet calls' results bit for bit."""

import pytest
import torch

from fleetserve.layers.fbgemm_calls import LINEAR_DYNAMIC_FP16, LINEAR_DYNAMIC_INT8
from fleetserve.layers.quantization import Fp16WeightGemm, Int8DynamicGemm, fbgemm_available, quantize_weight_per_row

pytestmark = pytest.mark.skipif(not fbgemm_available(), reason="no fbgemm kernels on this CPU")


@pytest.mark.parametrize("rows", [1, 8, 33])
@pytest.mark.parametrize("out_f,in_f", [(960, 576), (100, 24)])
def test_fp16_resolved_equals_packet(rows, out_f, in_f):
    g = torch.Generator().manual_seed(rows * 7 + out_f)
    w = torch.randn(out_f, in_f, generator=g) / in_f ** 0.5
    x = torch.randn(rows, in_f, generator=g)
    packed = torch.ops.quantized.linear_prepack_fp16(w, None)
    ref = torch.ops.quantized.linear_dynamic_fp16(x, packed)
    assert torch.equal(LINEAR_DYNAMIC_FP16(x, packed), ref)
    assert not torch.equal(ref, x @ w.T)  # really fp16 weights
    gemm = Fp16WeightGemm(w)
    assert torch.equal(gemm(x), ref)
    b = torch.randn(out_f, generator=g)
    assert torch.equal(gemm(x, None, b), ref + b)


@pytest.mark.parametrize("reduce_range", [True, False])
def test_int8_resolved_equals_packet(reduce_range):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 32, generator=g)
    x = torch.randn(5, 32, generator=g)
    packed = torch.ops.quantized.linear_prepack(quantize_weight_per_row(w), None)
    ref = torch.ops.quantized.linear_dynamic(x, packed, reduce_range)
    assert torch.equal(LINEAR_DYNAMIC_INT8(x, packed, reduce_range), ref)
    r = x.abs().amax(dim=1, keepdim=True).clamp_(min=1e-12)
    gemm = Int8DynamicGemm(w, reduce_range=reduce_range)  # per-token scales: rows divided by |x|max first
    want = torch.ops.quantized.linear_dynamic((x / r).contiguous(), packed, reduce_range) * r
    assert torch.equal(gemm(x), want)
