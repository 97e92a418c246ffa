"""PackedLinear (oneDNN prepacked float32 linear) against F.linear."""

import torch
import torch.nn.functional as F

from fleetserve.layers import cpu_gemm
from fleetserve.layers.cpu_gemm import PackedLinear


def test_packed_linear_matches_f_linear_and_sees_weight_updates():
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g)
    b = torch.randn(96, generator=g)
    lin = PackedLinear()
    for rows in (1, 5, 32, 200):  # below, inside and above the oneDNN row range
        x = torch.randn(rows, 64, generator=g)
        with torch.inference_mode():
            got = lin(x, w, b)
        torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    x = torch.randn(8, 64, generator=g)
    with torch.inference_mode():
        first = lin(x, w)
    w.copy_(torch.randn(96, 64, generator=g))  # in-place load: the packed copy must be rebuilt
    with torch.inference_mode():
        second = lin(x, w)
    torch.testing.assert_close(second, F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert (second - first).abs().max() > 1e-2
    if cpu_gemm.ENABLED:
        assert lin._packed is not None and lin._key[1] == w._version
