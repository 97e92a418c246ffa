"""int4wo-32 on the built-in SmolLM2 (a Q4_1 GGUF) finds the file's own 4-bit codes again.

Q4_1 (llama.cpp, ggml-quants): blocks of 32 weights, each ``{d: f16, m: f16, qs: 16 bytes}``,
weight ``j`` = ``d * q_j + m`` with ``q_j`` the low nibble of ``qs[j]`` for ``j < 16`` and the
high nibble of ``qs[j - 16]`` for ``j >= 16``. Requantizing the dequantized float32 weights with
:func:`quantize_int4_groups` (min/max per group, the rule Q4_1 was made with) must give exactly
those codes and ``(scale, min) = (d, m)`` to float32 rounding, so the int4 kernel multiplies by
the file's weights without a second rounding."""

import glob
import os

import numpy as np
import pytest
import torch

from fleetserve.layers.weight_only import quantize_int4_groups
from fleetserve.models.loader import dequantize_gguf


def q4_1_blocks(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes uint8 [rows, cols], d float32 [rows, cols / 32], m float32 [rows, cols / 32]) of Q4_1 bytes."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, 20)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., 4:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [rows, nblocks, 32]
    return codes.reshape(rows, -1), d, m


@pytest.fixture(scope="module")
def gguf_tensors(smollm2_path):
    import gguf

    path = smollm2_path if smollm2_path.endswith(".gguf") else glob.glob(os.path.join(smollm2_path, "*.gguf"))[0]
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "blk.3.ffn_down.weight", "blk.29.ffn_up.weight"])
def test_requantized_codes_equal_the_files(gguf_tensors, name):
    import gguf

    t = gguf_tensors[name]
    assert t.tensor_type == gguf.GGMLQuantizationType.Q4_1
    raw = np.asarray(t.data)
    codes, d, m = q4_1_blocks(raw)
    w = dequantize_gguf(raw, t.tensor_type)  # what the float32 engine multiplies by
    assert torch.allclose(w, torch.from_numpy((codes.reshape(*d.shape, 32) * d[..., None] + m[..., None])
                                              .reshape(codes.shape)), rtol=0, atol=1e-6)
    q, scale, lo = quantize_int4_groups(w, 32)
    assert torch.equal(q, torch.from_numpy(codes))
    assert torch.equal(lo, torch.from_numpy(m))
    assert torch.allclose(scale, torch.from_numpy(d), rtol=2e-6, atol=0)
    dq = (q.float().reshape(*scale.shape, 32) * scale[..., None] + lo[..., None]).reshape(w.shape)
    assert (dq - w).abs().max().item() <= 1e-5 * w.abs().max().item()
