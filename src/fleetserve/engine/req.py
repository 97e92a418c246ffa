"""One request's state inside the scheduler.

A :class:`Req` goes ``waiting -> (chunked) prefill -> running (decode) ->
finished``; a retraction sends it back to ``waiting`` with its output so far,
and its next prefill recomputes (or re-matches from the radix cache) the
prompt plus those outputs.

KV bookkeeping (all token counts, all slots int64):

* ``kv_slots[:num_kv]``: KV slots of ``fill_ids[:num_kv]`` (prompt + outputs so
  far), in order.
* ``kv_slots[:num_tree]`` belong to the radix tree (protected by the lock on
  ``last_node``); ``kv_slots[num_tree:num_kv]`` are the request's own ("in use").
"""

from __future__ import annotations

from typing import Any

import torch

from fleetserve.engine.io_struct import TokenizedGenerateReq
from fleetserve.engine.sampling_params import SamplingParams


class Req:
    """Scheduler-side state of one generation request (one sample).

    Attributes:
        rid: request id.
        origin_input_ids: prompt token ids.
        sampling: sampling parameters.
        output_ids: generated token ids so far.
        cached_tokens: prompt tokens reused from the radix cache at first admission.
        finish_reason: ``None`` while running, else an io_struct-style dict.
        generator: per-request ``torch.Generator`` when ``sampling.seed`` is set.
        grammar: its grammar matcher when ``sampling`` constrains the output (set when
            compiled; kept across retraction, having consumed every output token).
    """

    __slots__ = (
        "rid", "origin_input_ids", "sampling", "return_logprob", "top_logprobs_num", "logprob_start_len",
        "stream", "output_ids", "kv_slots", "num_kv", "num_tree", "last_node", "extend_len",
        "cached_tokens", "finish_reason", "generator", "arrival", "sent_tokens", "input_logprobs",
        "input_top_logprobs", "input_logprobs_sent", "output_logprobs", "output_top_logprobs",
        "max_len", "prefix_matched", "is_retracted", "steps_since_stream", "extra", "grammar",
    )

    def __init__(self, rid: str, input_ids: list[int], sampling: SamplingParams, *, return_logprob: bool = False,
                 top_logprobs_num: int = 0, logprob_start_len: int = -1, stream: bool = False, arrival: int = 0):
        self.rid = rid
        self.origin_input_ids = list(input_ids)
        self.sampling = sampling
        self.return_logprob = return_logprob
        self.top_logprobs_num = int(top_logprobs_num or 0)
        self.logprob_start_len = logprob_start_len if return_logprob else -1
        self.stream = stream
        self.output_ids: list[int] = []
        self.kv_slots = torch.zeros(max(16, len(input_ids) + 16), dtype=torch.int64)
        self.num_kv = 0
        self.num_tree = 0
        self.last_node: Any = None
        self.extend_len = 0
        self.cached_tokens = 0
        self.finish_reason: dict[str, Any] | None = None
        self.generator: torch.Generator | None = None
        if sampling.seed is not None:
            self.generator = torch.Generator().manual_seed(int(sampling.seed))
        self.arrival = arrival
        self.sent_tokens = 0
        self.input_logprobs: list = []
        self.input_top_logprobs: list = []
        self.input_logprobs_sent = False
        self.output_logprobs: list[tuple[float, int]] = []
        self.output_top_logprobs: list[list[tuple[float, int]]] = []
        self.max_len = 0  # set by the scheduler: context limit on prompt + output
        self.prefix_matched = False
        self.is_retracted = False
        self.steps_since_stream = 0
        self.extra: dict[str, Any] = {}
        self.grammar: Any = None  # the grammar matcher (fleetserve.engine.grammar) once compiled

    @classmethod
    def from_tokenized(cls, msg: TokenizedGenerateReq, arrival: int = 0) -> "Req":
        return cls(msg.rid, msg.input_ids, msg.sampling, return_logprob=msg.return_logprob,
                   top_logprobs_num=msg.top_logprobs_num, logprob_start_len=msg.logprob_start_len,
                   stream=msg.stream, arrival=arrival)

    # ------------------------------------------------------------------ tokens
    @property
    def fill_ids(self) -> list[int]:
        """Prompt followed by the outputs so far (what a (re-)prefill computes)."""
        return self.origin_input_ids + self.output_ids if self.output_ids else self.origin_input_ids

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def wants_input_logprobs(self) -> bool:
        return self.logprob_start_len >= 0 and not self.input_logprobs_sent and not self.is_retracted

    # --------------------------------------------------------------------- KV
    def kv_indices(self) -> torch.Tensor:
        """int64 ``[num_kv]`` slots of all computed tokens (a view)."""
        return self.kv_slots[: self.num_kv]

    def own_slots(self) -> torch.Tensor:
        """Slots owned by this request and not yet in the radix tree (a view)."""
        return self.kv_slots[self.num_tree: self.num_kv]

    def append_slots(self, slots: torch.Tensor) -> None:
        """Record the slots of the next ``len(slots)`` computed tokens."""
        n = int(slots.numel())
        end = self.num_kv + n
        if end > self.kv_slots.numel():
            bigger = torch.zeros(max(end, 2 * self.kv_slots.numel()), dtype=torch.int64)
            bigger[: self.num_kv] = self.kv_slots[: self.num_kv]
            self.kv_slots = bigger
        self.kv_slots[self.num_kv: end] = slots
        self.num_kv = end

    def set_tree_prefix(self, slots: torch.Tensor, node: Any) -> None:
        """Replace the first ``len(slots)`` KV slots with the tree's (after match or insert)."""
        n = int(slots.numel())
        if n > self.kv_slots.numel():
            self.append_slots(torch.zeros(n - self.num_kv, dtype=torch.int64))
        self.kv_slots[:n] = slots
        self.num_tree = n
        self.num_kv = max(self.num_kv, n)
        self.last_node = node

    def reset_kv(self) -> None:
        self.num_kv = 0
        self.num_tree = 0
        self.last_node = None

    def __repr__(self) -> str:
        return (f"Req(rid={self.rid!r}, prompt={len(self.origin_input_ids)}, out={len(self.output_ids)}, "
                f"kv={self.num_kv}, tree={self.num_tree}, finish={self.finish_reason})")
