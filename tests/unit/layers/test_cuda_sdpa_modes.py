"""The CUDA attention modes (FLEETSERVE_CUDA_SDPA): their switch and the GQA head expansion."""

import pytest
import torch
import torch.nn.functional as F

from fleetserve.layers import attention
from fleetserve.layers.attention import configure_cuda_sdpa, expand_kv_heads


@pytest.fixture(autouse=True)
def _restore_cudnn_flag():
    before = torch.backends.cuda.cudnn_sdp_enabled()
    mode = attention._CUDA_SDPA["mode"]
    yield
    torch.backends.cuda.enable_cudnn_sdp(before)
    attention._CUDA_SDPA["mode"] = mode


@pytest.mark.parametrize("mode, cudnn", [("auto", True), ("no_cudnn", False), ("expand", False)])
def test_each_mode_sets_the_cudnn_switch(mode, cudnn):
    assert configure_cuda_sdpa(mode) == mode
    assert torch.backends.cuda.cudnn_sdp_enabled() is cudnn


def test_the_environment_names_the_mode_and_the_default_is_no_cudnn(monkeypatch):
    monkeypatch.setenv("FLEETSERVE_CUDA_SDPA", "expand")
    assert configure_cuda_sdpa() == "expand"
    monkeypatch.delenv("FLEETSERVE_CUDA_SDPA")
    assert configure_cuda_sdpa() == "no_cudnn"
    assert torch.backends.cuda.cudnn_sdp_enabled() is False


def test_an_unknown_mode_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.setenv("FLEETSERVE_CUDA_SDPA", "flashinfer")
    with pytest.raises(ValueError, match=r"^FLEETSERVE_CUDA_SDPA must be one of"):
        configure_cuda_sdpa()


def test_expanded_heads_attend_as_grouped_query_attention():
    g = torch.Generator().manual_seed(0)
    B, L, hq, hk, d = 2, 7, 6, 2, 8
    q = torch.randn(B, hq, 1, d, generator=g)
    k = torch.randn(B, L, hk, d, generator=g)
    v = torch.randn(B, L, hk, d, generator=g)
    grouped = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True)
    ke, ve = expand_kv_heads(k, hq), expand_kv_heads(v, hq)
    assert ke.shape == (B, L, hq, d)
    assert torch.equal(ke[:, :, 2], k[:, :, 0]) and torch.equal(ke[:, :, 3], k[:, :, 1])  # heads 3..5 read KV head 1
    expanded = F.scaled_dot_product_attention(q, ke.transpose(1, 2), ve.transpose(1, 2))
    torch.testing.assert_close(expanded, grouped)
