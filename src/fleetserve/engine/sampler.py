"""Pick each request's next token from its logits; logprobs of the choice.

Order of operations per row (as in SGLang / vLLM):

1. penalties on the raw logits: repetition (CTRL, Keskar et al. 2019: a seen
   token's logit is divided by ``p`` when positive, multiplied by ``p`` when
   negative; "seen" = prompt or output), then OpenAI's frequency and presence
   penalties over the output so far: ``logit -= freq * count + pres * (count > 0)``;
2. greedy rows (``temperature == 0`` or ``top_k == 1``): argmax;
3. other rows: ``softmax(logit / temperature)``, then the top_k, top_p
   (smallest set of most likely tokens whose mass reaches ``top_p``) and
   min_p (drop ``p < min_p * p_max``) masks, renormalise, draw one sample:
   from the request's own ``torch.Generator`` when it set ``seed``
   (deterministic), else from the engine-wide generator.

Logprobs (``return_logprob``) are ``log_softmax`` of the raw logits, before
penalties and temperature (SGLang's default), with the top ``top_logprobs_num``
alternatives, best first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fleetserve.engine.req import Req


def apply_penalties(logits: torch.Tensor, reqs: Sequence[Req]) -> None:
    """Apply repetition / frequency / presence penalties in place.

    Args:
        logits: float32 ``[B, V]``, row ``i`` for ``reqs[i]``.
    """
    vocab = logits.shape[-1]
    for i, r in enumerate(reqs):
        sp = r.sampling
        if sp.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(r.origin_input_ids) | set(r.output_ids)), dtype=torch.int64)
            row = logits[i, seen]
            logits[i, seen] = torch.where(row > 0, row / sp.repetition_penalty, row * sp.repetition_penalty)
        if (sp.frequency_penalty != 0.0 or sp.presence_penalty != 0.0) and r.output_ids:
            counts = torch.bincount(torch.tensor(r.output_ids, dtype=torch.int64), minlength=vocab)[:vocab]
            counts = counts.to(logits.dtype)
            logits[i] -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).to(logits.dtype)


def mask_probs(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero the tokens excluded by top_k / top_p / min_p and renormalise.

    Args:
        probs: float32 ``[B, V]`` rows summing to 1.
        top_k: int64 ``[B]``; ``<= 0`` keeps all.
        top_p: float32 ``[B]`` in (0, 1]; a token is kept while the mass of the
            more likely tokens before it is below ``top_p`` (the top token always stays).
        min_p: float32 ``[B]``; keep ``p >= min_p * max(p)``.

    Returns:
        float32 ``[B, V]``, each row summing to 1.
    """
    vocab = probs.shape[-1]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=probs.device).unsqueeze(0)
    keep = ranks < k.unsqueeze(1)
    before = sorted_p.cumsum(dim=-1) - sorted_p
    keep &= before < top_p.unsqueeze(1)
    keep &= sorted_p >= min_p.unsqueeze(1) * sorted_p[:, :1]
    keep[:, 0] = True
    sorted_p = sorted_p * keep
    out = torch.zeros_like(probs).scatter_(1, order, sorted_p)
    return out / out.sum(dim=-1, keepdim=True)


@dataclass
class SampleOutput:
    """Result of one sampling call for ``B`` rows.

    Attributes:
        next_ids: ``B`` chosen token ids.
        logprobs: per row ``(logprob, token_id)`` of the choice, or ``None`` when the row
            did not ask for logprobs.
        top_logprobs: per row the top alternatives ``[(logprob, token_id), ...]`` or ``None``.
    """

    next_ids: list[int]
    logprobs: list[tuple[float, int] | None]
    top_logprobs: list[list[tuple[float, int]] | None]


def top_logprob_list(logprobs_row: torch.Tensor, k: int) -> list[tuple[float, int]]:
    """Best ``k`` ``(logprob, token_id)`` of one ``[V]`` row, best first."""
    if k <= 0:
        return []
    vals, ids = logprobs_row.topk(min(k, logprobs_row.shape[-1]))
    return list(zip(vals.tolist(), ids.tolist()))


class Sampler:
    """Batched sampler.

    Args:
        seed: seed of the engine-wide generator used by requests without ``seed``
            (``None``: a nondeterministic seed).
    """

    def __init__(self, seed: int | None = None):
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(int(seed))

    def __call__(self, logits: torch.Tensor, reqs: Sequence[Req]) -> SampleOutput:
        """Sample one token per row.

        Args:
            logits: float32 ``[B, V]`` (row ``i`` for ``reqs[i]``); may be modified in place.
            reqs: the ``B`` requests (their sampling params, outputs, generators).
        """
        bsz = logits.shape[0]
        logits = logits.float()
        want_lp = [r.return_logprob for r in reqs]
        raw_logprobs = None
        if any(want_lp):
            raw_logprobs = torch.log_softmax(logits.float(), dim=-1)
        if any(r.sampling.repetition_penalty != 1.0 or r.sampling.frequency_penalty != 0.0
               or r.sampling.presence_penalty != 0.0 for r in reqs):
            apply_penalties(logits, reqs)

        greedy = [r.sampling.is_greedy for r in reqs]
        next_ids = logits.argmax(dim=-1)
        if not all(greedy):
            rows = [i for i in range(bsz) if not greedy[i]]
            next_ids = next_ids.clone()
            sub = logits[rows].float()
            temps = torch.tensor([reqs[i].sampling.temperature for i in rows], dtype=torch.float32)
            probs = torch.softmax(sub / temps.unsqueeze(1), dim=-1)
            if any(reqs[i].sampling.top_k > 0 or reqs[i].sampling.top_p < 1.0 or reqs[i].sampling.min_p > 0.0
                   for i in rows):
                probs = mask_probs(
                    probs,
                    torch.tensor([reqs[i].sampling.top_k for i in rows], dtype=torch.int64),
                    torch.tensor([reqs[i].sampling.top_p for i in rows], dtype=torch.float32),
                    torch.tensor([reqs[i].sampling.min_p for i in rows], dtype=torch.float32),
                )
            shared = [j for j, i in enumerate(rows) if reqs[i].generator is None]
            if shared:
                drawn = torch.multinomial(probs[shared], 1, generator=self.generator).flatten()
                next_ids[torch.tensor([rows[j] for j in shared])] = drawn
            for j, i in enumerate(rows):
                g = reqs[i].generator
                if g is not None:
                    next_ids[i] = torch.multinomial(probs[j], 1, generator=g)[0]

        ids = next_ids.tolist()
        lps: list[tuple[float, int] | None] = [None] * bsz
        tops: list[list[tuple[float, int]] | None] = [None] * bsz
        if raw_logprobs is not None:
            for i in range(bsz):
                if want_lp[i]:
                    lps[i] = (float(raw_logprobs[i, ids[i]]), ids[i])
                    tops[i] = top_logprob_list(raw_logprobs[i], reqs[i].top_logprobs_num)
        return SampleOutput(ids, lps, tops)
