"""Logit and token parity checks of a ModelRunner against a transformers model."""

from __future__ import annotations

import torch

from helpers.batch_driver import Req, free, greedy_generate, run_decode, run_extend


@torch.no_grad()
def hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    """transformers' float32 logits ``[len(tokens), vocab]`` of one sequence (no cache)."""
    return hf_model(torch.tensor([tokens])).logits[0].float()


def max_diff_extend_and_decode(runner, hf_model, prompts: list[list[int]], cached: list[int],
                               decode_tokens: list[list[int]]) -> dict[str, float]:
    """Max |ours - transformers| over three phases, all through the KV pool:

    1. EXTEND of each prompt's first ``cached[i]`` tokens (requests with
       ``cached[i] == 0`` skip this phase);
    2. one batched EXTEND of the rest of every prompt (after its cached prefix),
       comparing the logits of every new token;
    3. ``len(decode_tokens)`` batched DECODE steps, step ``s`` appending
       ``decode_tokens[s][i]`` to request ``i``.

    The reference is one causal transformers forward per request over its final
    sequence (prompt + decoded tokens): row ``j`` of it is the logit of the
    token after position ``j``, whatever was cached when we computed ours.
    """
    reqs = [Req([]) for _ in prompts]
    ref = [hf_logits(hf_model, p + [step[i] for step in decode_tokens]) for i, p in enumerate(prompts)]
    first = [(i, p[:c]) for i, (p, c) in enumerate(zip(prompts, cached)) if c > 0]
    out = {}
    if first:
        lg = run_extend(runner, [reqs[i] for i, _ in first], [p for _, p in first], return_all_logits=True)
        off, d = 0, 0.0
        for i, p in first:
            d = max(d, (lg[off:off + len(p)] - ref[i][: len(p)]).abs().max().item())
            off += len(p)
        out["prefix_extend"] = d
    lg = run_extend(runner, reqs, [p[c:] for p, c in zip(prompts, cached)], return_all_logits=True)
    off, d = 0, 0.0
    for i, (p, c) in enumerate(zip(prompts, cached)):
        n = len(p) - c
        d = max(d, (lg[off:off + n] - ref[i][c:len(p)]).abs().max().item())
        off += n
    out["extend_after_prefix"] = d
    d = 0.0
    for s, step in enumerate(decode_tokens):
        lg = run_decode(runner, reqs, step)
        for i, p in enumerate(prompts):
            d = max(d, (lg[i] - ref[i][len(p) + s]).abs().max().item())
    out["decode"] = d
    free(runner, reqs)
    return out


def greedy_matches_teacher_forced(hf_model, prompt: list[int], continuation: list[int]) -> bool:
    """Whether every token of ``continuation`` is transformers' argmax given the
    tokens before it (one forward over ``prompt + continuation``): the same
    condition as being transformers' greedy continuation."""
    logits = hf_logits(hf_model, prompt + continuation)
    n = len(prompt)
    return logits[n - 1:n - 1 + len(continuation)].argmax(-1).tolist() == continuation


@torch.no_grad()
def hf_greedy(hf_model, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of ``n`` tokens (EOS ignored)."""
    ids = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
                            max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                            pad_token_id=0)
    return ids[0, len(prompt):].tolist()


__all__ = ["hf_logits", "max_diff_extend_and_decode", "hf_greedy", "greedy_generate", "greedy_matches_teacher_forced"]
