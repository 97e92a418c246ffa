"""layers/fp16_gemm_ext.py: off unless asked; when on, the C++ op gives the quantized op's result bit for bit.

The equality test needs the extension built (1-4 min of C++ compiling on this machine), so it runs
only where an earlier ``FLEETSERVE_FP16_GEMM_EXT=1`` run left the build in ``TORCH_EXTENSIONS_DIR``.
"""

import os

import pytest
import torch

from fleetserve.layers import fp16_gemm_ext
from fleetserve.layers.quantization import Fp16WeightGemm, fbgemm_available

pytestmark = pytest.mark.skipif(not fbgemm_available(), reason="no fbgemm kernels on this CPU")


def _built() -> bool:
    from torch.utils.cpp_extension import _get_build_directory

    return os.path.isfile(os.path.join(_get_build_directory("fleetserve_fp16", False), "fleetserve_fp16.so"))


def test_off_by_default(monkeypatch):
    monkeypatch.delenv(fp16_gemm_ext.ENV, raising=False)
    monkeypatch.setattr(fp16_gemm_ext, "_state", {})
    assert fp16_gemm_ext.enabled() is False
    assert Fp16WeightGemm(torch.randn(32, 16))._ext is None


@pytest.mark.skipif(not _built(), reason="fleetserve_fp16 extension not built here (slow to build)")
@pytest.mark.parametrize("rows", [1, 5])
def test_ext_equals_quantized_op(monkeypatch, rows):
    monkeypatch.setenv(fp16_gemm_ext.ENV, "1")
    monkeypatch.setattr(fp16_gemm_ext, "_state", dict(fp16_gemm_ext._state) if fp16_gemm_ext._state.get("ok") else {})
    assert fp16_gemm_ext.enabled()
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=g) / 8
    x = torch.randn(rows, 64, generator=g)
    gemm = Fp16WeightGemm(w)
    assert gemm._ext is not None
    ref = torch.ops.quantized.linear_dynamic_fp16(x, gemm._packed)
    assert torch.equal(gemm(x), ref)
    assert torch.equal(fp16_gemm_ext.gemm(x, gemm._ext), ref)
    assert fp16_gemm_ext.gemm(x, gemm._ext).shape == (rows, 96)
    with pytest.raises(RuntimeError, match="bad handle"):
        fp16_gemm_ext.gemm(x, 10 ** 6)
