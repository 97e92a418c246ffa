"""Turn the requests chosen for one step into a :class:`ForwardBatch`.

The scheduler has already allocated the KV slots of the new tokens and
recorded them in each request (``Req.append_slots``); this module only lays
the numbers out flat, request after request, as the model runner expects.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fleetserve.core.forward_batch import ForwardBatch, ForwardMode
from fleetserve.engine.req import Req


@dataclass
class ScheduleBatch:
    """One step's requests and the :class:`ForwardBatch` built from them.

    Attributes:
        mode: EXTEND, DECODE or IDLE.
        reqs: the ``B`` requests, in row order.
        extend_lens: new tokens per request this step (DECODE: ones).
        prefix_lens: tokens already in the KV cache before this step, per request.
        forward_batch: the model input; the DP-attention hook may set its
            ``global_num_tokens`` / ``can_run_graph`` before the forward.
        prefill_done: EXTEND only: per request, whether this step computes the
            rest of its prompt (False for a request cut by chunked prefill).
    """

    mode: ForwardMode
    reqs: list[Req] = field(default_factory=list)
    extend_lens: list[int] = field(default_factory=list)
    prefix_lens: list[int] = field(default_factory=list)
    forward_batch: ForwardBatch | None = None
    prefill_done: list[bool] = field(default_factory=list)

    @property
    def batch_size(self) -> int:
        return len(self.reqs)

    @property
    def num_tokens(self) -> int:
        """New tokens in this step (the count DP attention all-gathers)."""
        return sum(self.extend_lens)

    @classmethod
    def idle(cls, device: str | torch.device = "cpu") -> "ScheduleBatch":
        """A zero-token batch (DP attention: this rank joins the collectives only)."""
        return cls(ForwardMode.IDLE, forward_batch=ForwardBatch.idle(device))


def build_extend(reqs: list[Req], prefix_lens: list[int], extend_lens: list[int],
                 return_all_logits: bool = False, device: str | torch.device = "cpu") -> ScheduleBatch:
    """EXTEND batch: request ``i`` computes ``fill_ids[prefix_lens[i] : prefix_lens[i] + extend_lens[i]]``.

    Each request's ``kv_indices()`` must already cover ``prefix_lens[i] + extend_lens[i]`` tokens.
    """
    input_ids: list[int] = []
    positions: list[int] = []
    locs: list[torch.Tensor] = []
    kv: list[torch.Tensor] = []
    for r, p, e in zip(reqs, prefix_lens, extend_lens):
        input_ids.extend(r.fill_ids[p: p + e])
        positions.extend(range(p, p + e))
        idx = r.kv_slots[: p + e]
        kv.append(idx)
        locs.append(idx[p:])
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    fb = ForwardBatch(
        mode=ForwardMode.EXTEND,
        input_ids=torch.tensor(input_ids, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        out_cache_loc=torch.cat(locs),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
        extend_prefix_lens=torch.tensor(prefix_lens, dtype=torch.int64),
        extend_seq_lens=torch.tensor(extend_lens, dtype=torch.int64),
        kv_indices=kv,
        return_all_logits=return_all_logits,
    )
    if str(device) != "cpu":
        fb = to_device(fb, device)
    return ScheduleBatch(ForwardMode.EXTEND, list(reqs), list(extend_lens), list(prefix_lens), fb)


def build_decode(reqs: list[Req], out_cache_loc: torch.Tensor, device: str | torch.device = "cpu") -> ScheduleBatch:
    """DECODE batch: one new token (each request's last output) per request.

    ``out_cache_loc`` (int64 ``[B]``) must already be appended to each request's slots.
    """
    seq_lens = [r.num_kv for r in reqs]
    fb = ForwardBatch(
        mode=ForwardMode.DECODE,
        input_ids=torch.tensor([r.output_ids[-1] for r in reqs], dtype=torch.int64),
        positions=torch.tensor([n - 1 for n in seq_lens], dtype=torch.int64),
        out_cache_loc=out_cache_loc,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
        extend_prefix_lens=torch.tensor([n - 1 for n in seq_lens], dtype=torch.int64),
        extend_seq_lens=torch.ones(len(reqs), dtype=torch.int64),
        kv_indices=[r.kv_slots[: r.num_kv] for r in reqs],
    )
    if str(device) != "cpu":
        fb = to_device(fb, device)
    return ScheduleBatch(ForwardMode.DECODE, list(reqs), [1] * len(reqs), [n - 1 for n in seq_lens], fb)


def to_device(fb: ForwardBatch, device: str | torch.device) -> ForwardBatch:
    """Copy every tensor of ``fb`` to ``device`` (non-CPU runners)."""
    for name in ("input_ids", "positions", "out_cache_loc", "seq_lens", "extend_prefix_lens", "extend_seq_lens"):
        setattr(fb, name, getattr(fb, name).to(device, non_blocking=True))
    fb.kv_indices = [t.to(device, non_blocking=True) for t in fb.kv_indices]
    return fb
