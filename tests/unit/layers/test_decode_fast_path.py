"""The eager decode fast path (``fleetserve.core.fast_path``) computes what the general path does.

Parts that run the same float32 operations in the same order (rotary on queries and keys
together, RMSNorm with in-place steps, ``index_copy_`` KV writes) must match bit for bit;
the whole model, whose only other change is attention without a mask when every key is
visible, must give the same greedy tokens and logits to float32 rounding.
"""

import pytest
import torch

from fleetserve.core import fast_path
from fleetserve.core.forward_batch import ForwardBatch, ForwardMode
from fleetserve.core.forward_context import ForwardContext
from fleetserve.core.kv_pool import MHAKVPool
from fleetserve.engine.model_runner import ModelRunner
from fleetserve.layers.norm import RMSNorm
from fleetserve.layers.rotary import RotaryEmbedding
from helpers.batch_driver import Req, free, greedy_generate, run_decode, run_extend


@pytest.fixture
def fast(monkeypatch):
    """Set the switch for one test; returns a setter."""
    def set_(on: bool) -> None:
        monkeypatch.setattr(fast_path, "ENABLED", on)
    return set_


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotate_heads_is_rotate_bit_for_bit(dtype):
    torch.manual_seed(0)
    rope = RotaryEmbedding(64, {"rope_type": "default", "rope_theta": 100000.0}, 2048)
    pos = torch.tensor([0, 5, 17, 300, 2047])
    q, k = torch.randn(5, 9, 64, dtype=dtype), torch.randn(5, 3, 64, dtype=dtype)
    q_ref, k_ref = rope(pos, q, k)
    rope.prepare(pos)
    both = rope.rotate_heads(pos, torch.cat([q, k], dim=1))
    assert torch.equal(both[:, :9], q_ref) and torch.equal(both[:, 9:], k_ref)
    assert not torch.equal(q_ref, q)  # the rotation did something
    # without prepare (other positions): same result
    pos2 = torch.tensor([1, 2, 3, 4, 5])
    assert torch.equal(rope.rotate_heads(pos2, q), rope(pos2, q, k)[0])


def test_rmsnorm_fast_is_general_bit_for_bit(fast):
    torch.manual_seed(1)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = torch.randn(576)
    x = torch.randn(7, 576) * 3
    fast(False)
    ref = norm(x)
    fast(True)
    assert torch.equal(norm(x), ref)


def test_set_kv_index_copy_matches_setitem(fast):
    torch.manual_seed(2)
    pools = [MHAKVPool(16, 2, 3, 8, torch.float32) for _ in range(2)]
    loc = torch.tensor([4, 9, 1])
    k, v = torch.randn(3, 3, 8), torch.randn(3, 3, 8)
    for on, pool in zip((False, True), pools):
        fast(on)
        pool.set_kv(1, loc, k, v)
    assert torch.equal(pools[0].k_buffer[1], pools[1].k_buffer[1])
    assert torch.equal(pools[0].v_buffer[1], pools[1].v_buffer[1])
    assert torch.equal(pools[1].k_buffer[1][9], k[1])


def _decode_batch(seq_lens: list[int]) -> ForwardBatch:
    B = len(seq_lens)
    kv = [torch.arange(1, n + 1) + 100 * i for i, n in enumerate(seq_lens)]
    return ForwardBatch(ForwardMode.DECODE, torch.zeros(B, dtype=torch.int64), torch.tensor(seq_lens) - 1,
                        torch.stack([x[-1] for x in kv]), torch.tensor(seq_lens), torch.tensor(seq_lens) - 1,
                        torch.ones(B, dtype=torch.int64), kv)


def test_full_mask_only_when_every_key_is_visible(fast):
    fast(True)
    one = ForwardContext.build(_decode_batch([7]))
    assert one.full_mask and one.additive_mask(torch.float32) is None and one.kv_idx.shape == (1, 7)
    assert one.kv_start == 1  # slots 1..7: attention reads a view of the pool
    same = ForwardContext.build(_decode_batch([5, 5, 5]))
    assert same.full_mask and same.additive_mask(torch.float32) is None
    ragged = ForwardContext.build(_decode_batch([5, 3]))
    assert not ragged.full_mask and ragged.kv_start is None
    m = ragged.additive_mask(torch.float32)
    assert m.shape == (2, 1, 1, 5) and torch.isinf(m[1, 0, 0, 3:]).all() and (m[1, 0, 0, :3] == 0).all()
    fast(False)
    off = ForwardContext.build(_decode_batch([7]))
    assert not off.full_mask and off.additive_mask(torch.float32).shape == (1, 1, 1, 7) and off.kv_start is None


@pytest.fixture(scope="module")
def llama_runner(tiny_llama_dir):
    return ModelRunner(tiny_llama_dir, dtype="float32", max_total_tokens=1024, show_progress=False)


def test_model_fast_path_same_logits_and_tokens(llama_runner, fast):
    """Prefill + decode of requests of equal and unequal lengths, both paths."""
    prompts = [list(range(3, 14)), list(range(20, 25)), list(range(30, 41))]  # lengths 11, 5, 11
    out = {}
    for on in (False, True):
        fast(on)
        reqs = [Req([]) for _ in prompts]
        steps = [run_extend(llama_runner, reqs, prompts)]
        for t in range(4):
            steps.append(run_decode(llama_runner, reqs, [5 + t, 6 + t, 7 + t]))  # ragged: 11/5/11
        single = [Req([])]
        run_extend(llama_runner, single, [prompts[0]])
        steps += [run_decode(llama_runner, single, [9 + t]) for t in range(3)]  # B = 1: no mask
        free(llama_runner, reqs + single)
        out[on] = steps
        out[(on, "greedy")] = greedy_generate(llama_runner, [prompts[0], prompts[2]], 12)
    for a, b in zip(out[False], out[True]):
        assert a.std().item() > 0.1
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    assert out[(False, "greedy")] == out[(True, "greedy")]


@pytest.mark.parametrize("mode", ["decode", "extend"])
def test_kv_view_is_the_gather_bit_for_bit(llama_runner, fast, mode):
    """One request on one ascending run of slots: K/V read as a pool view give the gather's output."""
    fast(True)
    torch.manual_seed(3)
    attn, pool = llama_runner.model.layers[0].self_attn, llama_runner.kv_pool
    pool.k_buffer[0][1:40].normal_()
    pool.v_buffer[0][1:40].normal_()
    n, new = 12, (1 if mode == "decode" else 5)
    kv = torch.arange(10, 10 + n)  # slots 10..21; the last `new` are this step's
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    batch = ForwardBatch(ForwardMode.DECODE if mode == "decode" else ForwardMode.EXTEND,
                         torch.zeros(new, dtype=torch.int64), torch.arange(n - new, n), kv[n - new:].clone(),
                         t([n]), t([n - new]), t([new]), [kv])
    meta = ForwardContext.build(batch)
    assert meta.kv_start == 10
    hidden = torch.randn(new, attn.o_proj.weight.shape[0])
    view = attn(hidden, meta, pool)
    meta.kv_start = None  # the gather path, same inputs (the KV writes repeat the same values)
    assert torch.equal(attn(hidden, meta, pool), view) and view.abs().sum() > 0
