"""The compiled decode step's attention (``decode_attention_reduction``) equals SDPA's.

Inside ``torch.compile`` a DECODE batch's attention is written as products and sums so that
inductor fuses the KV gather into the reductions; these tests pin that it computes what
``F.scaled_dot_product_attention`` computes over the gathered K/V (GQA / MQA / MHA, ragged
lengths, no mask), eagerly and compiled with a dynamic KV width, and that the compiled
``ragged_attention`` really takes that path (and SDPA when the switch is off).
"""

import pytest
import torch
import torch.nn.functional as F

from fleetserve.core.forward_batch import ForwardBatch, ForwardMode
from fleetserve.core.forward_context import ForwardContext
from fleetserve.layers import attention
from fleetserve.layers.attention import decode_attention_reduction, gather_rows, ragged_attention


def _decode_case(hq: int, hk: int, lens: list[int], d: int = 16, pool: int = 200, seed: int = 0):
    """A DECODE batch over a shuffled pool: (q [B, hq, d], kbuf, vbuf, ForwardContext)."""
    g = torch.Generator().manual_seed(seed)
    kbuf, vbuf = torch.randn(pool, hk, d, generator=g), torch.randn(pool, hk, d, generator=g)
    slots = (torch.randperm(pool - 1, generator=g) + 1).tolist()
    kv, at = [], 0
    for n in lens:
        kv.append(torch.tensor(slots[at: at + n]))
        at += n
    B = len(lens)
    batch = ForwardBatch(
        mode=ForwardMode.DECODE, input_ids=torch.zeros(B, dtype=torch.int64),
        positions=torch.tensor([n - 1 for n in lens]), out_cache_loc=torch.stack([s[-1] for s in kv]),
        seq_lens=torch.tensor(lens), extend_prefix_lens=torch.tensor([n - 1 for n in lens]),
        extend_seq_lens=torch.ones(B, dtype=torch.int64), kv_indices=kv)
    meta = ForwardContext.build(batch)
    return torch.randn(B, hq, d, generator=g), kbuf, vbuf, meta


def _reference(q, kbuf, vbuf, meta, scale):
    """SDPA request by request over exactly its own keys (no padding, no mask)."""
    outs = []
    hq, hk = q.shape[1], kbuf.shape[1]
    for b in range(meta.batch_size):
        n = int(meta.mask[b, 0, 0].sum())
        idx = meta.kv_idx[b, :n]
        k, v = kbuf[idx].transpose(0, 1), vbuf[idx].transpose(0, 1)  # [hk, n, d]
        o = F.scaled_dot_product_attention(q[b].unsqueeze(1), k, v, scale=scale, enable_gqa=hq != hk)
        outs.append(o.squeeze(1))
    return torch.stack(outs)


@pytest.mark.parametrize("hq,hk", [(9, 3), (4, 1), (2, 2)])
@pytest.mark.parametrize("lens", [[5, 17, 1, 9], [7, 7, 7]])
def test_reduction_equals_sdpa_per_request(hq, hk, lens):
    q, kbuf, vbuf, meta = _decode_case(hq, hk, lens)
    scale = 0.3
    got = decode_attention_reduction(q, gather_rows(kbuf, meta.kv_idx), gather_rows(vbuf, meta.kv_idx),
                                     meta.additive_mask(q.dtype), scale)
    want = _reference(q, kbuf, vbuf, meta, scale)
    assert got.shape == (len(lens), hq, kbuf.shape[-1]) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # the padding matters: without the mask the short requests would read other keys
    if len(set(lens)) > 1:
        unmasked = decode_attention_reduction(q, gather_rows(kbuf, meta.kv_idx), gather_rows(vbuf, meta.kv_idx),
                                              None, scale)
        assert not torch.allclose(unmasked, want, atol=1e-3)


def test_reduction_keeps_a_bfloat16_query_dtype_and_computes_in_float32():
    q, kbuf, vbuf, meta = _decode_case(6, 2, [4, 11])
    k, v = gather_rows(kbuf, meta.kv_idx).bfloat16(), gather_rows(vbuf, meta.kv_idx).bfloat16()
    got = decode_attention_reduction(q.bfloat16(), k, v, meta.additive_mask(torch.bfloat16), 0.25)
    want = decode_attention_reduction(q.bfloat16().float(), k.float(), v.float(), meta.additive_mask(torch.float32),
                                      0.25)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want.bfloat16())


class _GraphRecorder:
    """A torch.compile backend that keeps every call_function target it is given."""

    def __init__(self):
        self.targets: list = []

    def __call__(self, gm, example_inputs):
        self.targets += [n.target for n in gm.graph.nodes if n.op == "call_function"]
        return gm.forward


@pytest.mark.parametrize("fused", [True, False])
def test_compiled_ragged_attention_takes_the_reduction_path(monkeypatch, fused):
    monkeypatch.setattr(attention, "FUSED_DECODE_ATTENTION", fused)
    q, kbuf, vbuf, meta = _decode_case(9, 3, [5, 17, 1, 9])
    rec = _GraphRecorder()
    torch._dynamo.reset()

    def step(q, kv_idx):
        return ragged_attention(q, gather_rows(kbuf, kv_idx), gather_rows(vbuf, kv_idx), meta, 0.3)

    got = torch.compile(step, backend=rec, fullgraph=True)(q, meta.kv_idx)
    torch.testing.assert_close(got, _reference(q, kbuf, vbuf, meta, 0.3), rtol=1e-5, atol=1e-6)
    sdpa_in_graph = F.scaled_dot_product_attention in rec.targets
    assert sdpa_in_graph is (not fused), rec.targets


def test_inductor_compiled_reduction_over_two_widths_matches_sdpa():
    """One inductor graph with a dynamic KV width serves both batches and matches the reference."""
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda q, kbuf, vbuf, idx, mask: decode_attention_reduction(
            q, gather_rows(kbuf, idx), gather_rows(vbuf, idx), mask, 0.125), dynamic=False)
    for lens in ([3, 12, 8], [20, 2, 9]):
        q, kbuf, vbuf, meta = _decode_case(9, 3, lens, seed=len(lens) + lens[0])
        idx, mask = meta.kv_idx, meta.additive_mask(q.dtype)
        torch._dynamo.mark_dynamic(idx, 1)
        torch._dynamo.mark_dynamic(mask, 3)
        got = compiled(q, kbuf, vbuf, idx, mask)
        torch.testing.assert_close(got, _reference(q, kbuf, vbuf, meta, 0.125), rtol=1e-5, atol=1e-6)
