"""Sampling: masks, penalties, temperature, seeds and logprobs."""

import math

import torch

from fleetserve.engine.req import Req
from fleetserve.engine.sampler import Sampler, apply_penalties, mask_probs
from fleetserve.engine.sampling_params import SamplingParams


def req(prompt=(1, 2), out=(), **sp):
    r = Req("r", list(prompt), SamplingParams(**sp))
    r.output_ids = list(out)
    return r


def one(x):
    return torch.tensor([x])


def test_top_k_top_p_min_p_masks():
    p = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    k2 = mask_probs(p, one(2), one(1.0), one(0.0))
    assert torch.allclose(k2, torch.tensor([[0, 0.5 / 0.8, 0, 0.3 / 0.8]]))
    # top_p 0.8: 0.5 (mass before 0) and 0.3 (mass before 0.5) stay; 0.15 has 0.8 before it
    p8 = mask_probs(p, one(-1), one(0.8), one(0.0))
    assert torch.allclose(p8, k2)
    p81 = mask_probs(p, one(-1), one(0.81), one(0.0))
    assert torch.allclose(p81, torch.tensor([[0, 0.5, 0.15, 0.3]]) / 0.95)
    mp = mask_probs(p, one(-1), one(1.0), one(0.3))  # keep p >= 0.15
    assert torch.allclose(mp, torch.tensor([[0, 0.5, 0.15, 0.3]]) / 0.95)
    tiny = mask_probs(p, one(-1), one(1e-6), one(0.0))
    assert tiny.tolist() == [[0.0, 1.0, 0.0, 0.0]]
    full = mask_probs(p, one(0), one(1.0), one(0.0))
    assert torch.allclose(full, p)


def test_repetition_frequency_presence_math():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, 3.0]])
    apply_penalties(logits, [req(prompt=[0], out=[1], repetition_penalty=2.0)])
    assert logits.tolist() == [[1.0, -4.0, 1.0, 0.5, 3.0]]
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, 3.0]])
    apply_penalties(logits, [req(prompt=[4], out=[2, 2, 3], frequency_penalty=0.5, presence_penalty=0.25)])
    # token 2: -(0.5*2 + 0.25); token 3: -(0.5 + 0.25); prompt token 4 untouched
    assert torch.allclose(logits, torch.tensor([[2.0, -2.0, 1.0 - 1.25, 0.5 - 0.75, 3.0]]))


def test_greedy_and_logprobs_equal_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(3, 20)
    reqs = [req(temperature=0.0) for _ in range(3)]
    for r in reqs:
        r.return_logprob = True
        r.top_logprobs_num = 4
    out = Sampler(0)(logits.clone(), reqs)
    ref = torch.log_softmax(logits, -1)
    assert out.next_ids == logits.argmax(-1).tolist()
    for i in range(3):
        lp, tok = out.logprobs[i]
        assert tok == out.next_ids[i] and math.isclose(lp, float(ref[i, tok]), abs_tol=1e-6)
        vals, ids = ref[i].topk(4)
        assert [t for _, t in out.top_logprobs[i]] == ids.tolist()
        assert all(math.isclose(a, float(b), abs_tol=1e-6) for (a, _), b in zip(out.top_logprobs[i], vals))


def test_temperature_sampling_follows_softmax():
    logits = torch.tensor([1.0, 0.0, -1.0, 0.5])
    n = 8000
    reqs = [req(temperature=0.7) for _ in range(n)]
    out = Sampler(1)(logits.repeat(n, 1), reqs)
    freq = torch.bincount(torch.tensor(out.next_ids), minlength=4).float() / n
    assert torch.allclose(freq, torch.softmax(logits / 0.7, -1), atol=0.02)


def test_seed_is_deterministic_and_seeds_differ():
    torch.manual_seed(1)
    logits = torch.randn(40, 30)

    def draw(seed):
        r = req(temperature=1.0, top_p=0.95, seed=seed)
        return [Sampler(None)(logits[i:i + 1].clone(), [r]).next_ids[0] for i in range(40)]

    assert draw(5) == draw(5)
    assert draw(5) != draw(6)


def test_mixed_greedy_and_sampled_rows():
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 0.0, 50.0]])
    out = Sampler(0)(logits.clone(), [req(temperature=0.0), req(temperature=1.0, top_k=2)])
    assert out.next_ids == [1, 2]


def test_candidates_equal_full_sort_masks():
    from fleetserve.engine.sampler import candidates

    torch.manual_seed(3)
    scaled = torch.randn(6, 500) * torch.tensor([[0.1], [1.0], [3.0], [0.1], [1.0], [5.0]])
    top_k = torch.tensor([-1, 10, -1, -1, 300, -1])
    top_p = torch.tensor([0.9, 1.0, 0.5, 1.0, 0.99, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.5, 0.0, 0.05])
    ref = mask_probs(torch.softmax(scaled, -1), top_k, top_p, min_p)
    w, ids = candidates(scaled, top_k, top_p, min_p, k_floor=16)  # small K: rows 0, 3, 4 need the fallback
    got = torch.zeros_like(ref).scatter_add_(1, ids, w)
    got = got / got.sum(-1, keepdim=True)
    assert torch.allclose(got, ref, atol=1e-6)


def test_inverse_cdf_never_draws_zero_weight():
    from fleetserve.engine.sampler import inverse_cdf

    w = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]]).repeat(1000, 1)
    u = torch.rand(1000, generator=torch.Generator().manual_seed(0))
    col = inverse_cdf(w, u)
    assert set(col.tolist()) == {1, 3}
    assert abs((col == 1).float().mean().item() - 0.5) < 0.06


def test_top_p_top_k_sampling_follows_masked_softmax():
    logits = torch.tensor([1.0, 0.0, -1.0, 0.5, 0.2])
    n = 8000
    for kw in ({"top_p": 0.8}, {"top_k": 3}, {"min_p": 0.5}):
        reqs = [req(temperature=0.9, **kw) for _ in range(n)]
        out = Sampler(2)(logits.repeat(n, 1), reqs)
        freq = torch.bincount(torch.tensor(out.next_ids), minlength=5).float() / n
        sp = reqs[0].sampling
        ref = mask_probs(torch.softmax(logits / 0.9, -1).unsqueeze(0), one(sp.top_k), one(sp.top_p),
                         one(sp.min_p))[0]
        assert torch.allclose(freq, ref, atol=0.02), (kw, freq, ref)


def test_greedy_takes_the_first_of_tied_maxima():
    """Greedy rows pick argmax's index (the first maximum) even where several logits tie."""
    logits = torch.tensor([[1.0, 3.0, 0.5, 3.0, 3.0], [2.0, 2.0, 2.0, 2.0, 2.0], [0.0, -1.0, 4.0, 4.0, -5.0]])
    out = Sampler(0)(logits.clone(), [req(temperature=0.0) for _ in range(3)])
    assert out.next_ids == [1, 0, 2]
    g = torch.Generator().manual_seed(1)
    many = torch.randint(0, 4, (64, 3000), generator=g).float()  # thousands of ties per row
    assert Sampler(0)(many.clone(), [req(temperature=0.0) for _ in range(64)]).next_ids == many.argmax(-1).tolist()
