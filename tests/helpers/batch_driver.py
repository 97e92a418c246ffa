"""Drive a ModelRunner by hand in tests: build EXTEND / DECODE ForwardBatches
for a few requests, allocate their KV slots, and run greedy decoding.

A stand-in for the scheduler, small enough to read in one go, so model tests
do not depend on the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fleetserve.core.forward_batch import ForwardBatch, ForwardMode


@dataclass
class Req:
    """A request's token ids and the pool slots holding its KV."""

    tokens: list[int]
    slots: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))

    @property
    def cached(self) -> int:
        return int(self.slots.numel())


def run_extend(runner, reqs: list[Req], new_tokens: list[list[int]], return_all_logits: bool = False) -> torch.Tensor:
    """Append ``new_tokens[i]`` to ``reqs[i]`` and run them as one EXTEND batch
    (each request's already-cached tokens are its prefix)."""
    ids, pos, locs, seq, pre, ext, kv = [], [], [], [], [], [], []
    for r, new in zip(reqs, new_tokens):
        n0 = r.cached
        slots = runner.allocator.alloc(len(new))
        assert slots is not None, "KV pool exhausted"
        r.slots = torch.cat([r.slots, slots])
        r.tokens = r.tokens[:n0] + list(new)
        ids += new
        pos += list(range(n0, n0 + len(new)))
        locs.append(slots)
        seq.append(n0 + len(new))
        pre.append(n0)
        ext.append(len(new))
        kv.append(r.slots.clone())
    t = lambda x: torch.tensor(x, dtype=torch.int64)
    batch = ForwardBatch(mode=ForwardMode.EXTEND,
                         input_ids=t(ids), positions=t(pos), out_cache_loc=torch.cat(locs), seq_lens=t(seq),
                         extend_prefix_lens=t(pre), extend_seq_lens=t(ext), kv_indices=kv,
                         return_all_logits=return_all_logits)
    return runner.forward(batch)


def run_decode(runner, reqs: list[Req], next_tokens: list[int]) -> torch.Tensor:
    """One DECODE step: ``next_tokens[i]`` is appended to ``reqs[i]``; logits ``[B, vocab]``."""
    slots = runner.allocator.alloc(len(reqs))
    assert slots is not None, "KV pool exhausted"
    pos, seq, kv = [], [], []
    for i, (r, tok) in enumerate(zip(reqs, next_tokens)):
        pos.append(r.cached)
        r.slots = torch.cat([r.slots, slots[i:i + 1]])
        r.tokens = r.tokens + [tok]
        seq.append(r.cached)
        kv.append(r.slots.clone())
    t = lambda x: torch.tensor(x, dtype=torch.int64)
    B = len(reqs)
    batch = ForwardBatch(mode=ForwardMode.DECODE, input_ids=t(next_tokens), positions=t(pos), out_cache_loc=slots,
                         seq_lens=t(seq), extend_prefix_lens=t(seq) - 1, extend_seq_lens=torch.ones(B, dtype=torch.int64),
                         kv_indices=kv)
    return runner.forward(batch)


def greedy_generate(runner, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations: one EXTEND of all prompts, then batched DECODE steps."""
    reqs = [Req([]) for _ in prompts]
    logits = run_extend(runner, reqs, prompts)
    outs = [[int(x)] for x in logits.argmax(-1)]
    for _ in range(max_new_tokens - 1):
        logits = run_decode(runner, reqs, [o[-1] for o in outs])
        for o, x in zip(outs, logits.argmax(-1)):
            o.append(int(x))
    free(runner, reqs)
    return outs


def free(runner, reqs: list[Req]) -> None:
    for r in reqs:
        runner.allocator.free(r.slots)
        r.slots = torch.zeros(0, dtype=torch.int64)


def dp_agreed_forward(hook, runner, fb: ForwardBatch | None):
    """One DP-attention step as the scheduler runs it: the rank's batch (``fb``; None: idle) goes
    through ``hook`` (the DP-attention agreement), then ``runner.forward``.

    Returns ``(batch, logits, key)``: the agreed batch, its logits and the graph runner's
    ``last_key`` for this step (None: eager, or no graph runner).
    """
    from types import SimpleNamespace

    wrapped = None if fb is None else SimpleNamespace(mode=fb.mode, num_tokens=fb.num_tokens,
                                                      batch_size=fb.batch_size, forward_batch=fb)
    batch = hook(SimpleNamespace(runner=runner), wrapped)
    if runner.graph_runner is not None:
        runner.graph_runner.last_key = None
    logits = runner.forward(batch.forward_batch)
    return batch, logits, runner.graph_runner.last_key if runner.graph_runner is not None else None
