"""RoPE: YaRN against its formula, llama3 and interleaving against transformers."""

import math

import pytest
import torch

from fleetserve.layers.rotary import (RotaryEmbedding, get_rope_parameters, mla_softmax_scale, rope_inv_freq,
                                      yarn_get_mscale, yarn_inv_freq_and_mscale)

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707}


def yarn_by_formula(dim, base, factor, orig, beta_fast, beta_slow):
    """YaRN (arXiv:2309.00071 sec. 3.2 'NTK-by-parts', DeepSeek's variant), element by element."""
    def corr(rot):  # dimension index whose wavelength makes `rot` turns over `orig` positions
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(corr(beta_fast)), 0), min(math.ceil(corr(beta_slow)), dim - 1)
    out = []
    for i in range(dim // 2):
        theta = base ** (-2 * i / dim)
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)  # 0: extrapolate (keep), 1: interpolate
        out.append(theta * (1 - ramp) + theta / factor * ramp)
    return torch.tensor(out)


def test_yarn_inv_freq_matches_formula():
    inv, attn_factor = yarn_inv_freq_and_mscale(64, YARN, 163840)
    ref = yarn_by_formula(64, 10000.0, 40.0, 4096, 32, 1)
    torch.testing.assert_close(inv, ref.float(), rtol=1e-6, atol=0)
    assert inv[0] == pytest.approx(1.0)  # highest frequency kept
    assert inv[-1] == pytest.approx(10000.0 ** (-62 / 64) / 40.0, rel=1e-6)  # lowest interpolated
    # cos/sin factor: mscale(s, mscale) / mscale(s, mscale_all_dim), mscale(s, m) = 0.1 m ln s + 1
    assert attn_factor == pytest.approx((0.1 * math.log(40) + 1) / (0.1 * 0.707 * math.log(40) + 1))


def test_yarn_mscale_and_softmax_scale():
    assert yarn_get_mscale(1.0, 0.707) == 1.0
    assert yarn_get_mscale(40.0, 1.0) == pytest.approx(1 + 0.1 * math.log(40))
    m = 0.1 * 0.707 * math.log(40) + 1
    assert mla_softmax_scale(192, YARN) == pytest.approx(192 ** -0.5 * m * m)
    assert mla_softmax_scale(192, {"rope_type": "default", "rope_theta": 1e4}) == pytest.approx(192 ** -0.5)


def test_yarn_and_llama3_match_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from helpers.tiny_models import tiny_config

    for kind, dim in (("deepseek_v2", 8), ("llama", 16)):
        cfg = tiny_config(kind)
        params = get_rope_parameters(cfg)
        ours, f_ours = rope_inv_freq(dim, params, cfg.max_position_embeddings)
        ref, f_ref = ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg, None)
        torch.testing.assert_close(ours, ref.float(), rtol=1e-6, atol=0)
        assert f_ours == pytest.approx(f_ref)


def test_interleaved_rotation_is_complex_multiplication():
    """DeepSeek pairs (x[2i], x[2i+1]) rotate as a complex number times e^{i p theta_i};
    ours returns the same values with the pairs de-interleaved."""
    g = torch.Generator().manual_seed(0)
    rope = RotaryEmbedding(8, {"rope_type": "default", "rope_theta": 10000.0}, 512, interleaved=True)
    pos = torch.tensor([0, 3, 17, 200])
    x = torch.randn(4, 2, 8, generator=g)
    out, _ = rope(pos, x, x[:, :1])
    freqs = pos[:, None].float() * rope.inv_freq[None, :]
    z = torch.view_as_complex(x.reshape(4, 2, 4, 2)) * torch.polar(torch.ones_like(freqs), freqs)[:, None, :]
    ref = torch.view_as_real(z)  # [..., 4, 2]
    torch.testing.assert_close(out[..., :4], ref[..., 0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out[..., 4:], ref[..., 1], atol=1e-6, rtol=1e-6)
    # Dot products between rotated queries and keys depend only on relative position.
    q, k = torch.randn(1, 1, 8, generator=g), torch.randn(1, 1, 8, generator=g)
    a = (rope(torch.tensor([5]), q, k)[0] * rope(torch.tensor([2]), k, k)[0]).sum()
    b = (rope(torch.tensor([105]), q, k)[0] * rope(torch.tensor([102]), k, k)[0]).sum()
    assert a.item() == pytest.approx(b.item(), abs=1e-4)


def test_neox_rotation_matches_transformers_llama():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(1)
    rope = RotaryEmbedding(16, {"rope_type": "default", "rope_theta": 10000.0}, 512)
    pos = torch.tensor([0, 1, 9, 300])
    q, k = torch.randn(4, 3, 16, generator=g), torch.randn(4, 1, 16, generator=g)
    oq, ok = rope(pos, q, k)
    freqs = pos[:, None].float() * rope.inv_freq[None, :]
    emb = torch.cat([freqs, freqs], -1)
    rq, rk = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], emb.cos()[None], emb.sin()[None])
    torch.testing.assert_close(oq, rq[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ok, rk[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
