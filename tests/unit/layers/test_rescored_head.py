"""The int8 LM head with float32 rescoring of its top candidates (layers/rescored_head.py)."""

import pytest
import torch

from fleetserve.layers.quantization import Int8DynamicGemm, fbgemm_available
from fleetserve.layers.rescored_head import RescoredInt8Head

pytestmark = pytest.mark.skipif(not fbgemm_available(), reason="no fbgemm kernels on this CPU")


def test_argmax_and_top_logits_are_float32s():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(2000, 64, generator=g) / 8
    w[1:80:2] = w[0:80:2] + 2e-3 * torch.randn(40, 64, generator=g)  # 40 near-tied pairs of tokens
    x = 4 * w[0:80:2] + 0.1 * torch.randn(40, 64, generator=g)  # row i prefers pair i
    x[:, 3] *= 20  # an outlier channel, as in a real final hidden state
    ref = x @ w.T
    plain, head = Int8DynamicGemm(w)(x), RescoredInt8Head(w, k=8)(x)
    assert (plain.argmax(-1) != ref.argmax(-1)).any()  # the int8 head alone flips some rows
    assert torch.equal(head.argmax(-1), ref.argmax(-1))
    top = ref.topk(3, dim=-1).indices
    torch.testing.assert_close(head.gather(1, top), ref.gather(1, top), rtol=1e-5, atol=1e-5)
    assert head.shape == (40, 2000) and RescoredInt8Head(w)(torch.randn(0, 64)).shape == (0, 2000)
    b = torch.randn(2000, generator=g)
    torch.testing.assert_close(RescoredInt8Head(w, k=4)(x, w, b).max(-1).values, (ref + b).max(-1).values,
                               rtol=1e-5, atol=1e-5)
