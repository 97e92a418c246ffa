"""What one model forward sees: the batch of new tokens and where their KV lives.

This is the contract between the scheduler (which forms batches) and the model
runner (which executes them). Names follow SGLang's ``ForwardBatch``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch


class ForwardMode(enum.IntEnum):
    """Kind of a forward pass.

    * ``EXTEND``: prefill of the uncached part of each request's prompt
      (several new tokens per request, after a cached prefix).
    * ``DECODE``: exactly one new token per request.
    * ``IDLE``: zero tokens; a DP-attention rank with no work runs it so that
      it still joins the collectives of the MoE / dense FFN layers.
    """

    EXTEND = 1
    DECODE = 2
    IDLE = 3

    def is_extend(self) -> bool:
        return self == ForwardMode.EXTEND

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_idle(self) -> bool:
        return self == ForwardMode.IDLE

    def is_decode_or_idle(self) -> bool:
        return self in (ForwardMode.DECODE, ForwardMode.IDLE)


@dataclass
class ForwardBatch:
    """A batch of ``B`` requests contributing ``T`` new tokens in total.

    Token tensors are flat over the batch, request after request
    (request ``i`` owns ``extend_seq_lens[i]`` consecutive entries).

    Attributes:
        mode: EXTEND, DECODE or IDLE.
        input_ids: int64 ``[T]`` new token ids (DECODE: ``T == B``; IDLE: ``T == 0``).
        positions: int64 ``[T]`` absolute position of each new token.
        out_cache_loc: int64 ``[T]`` KV-pool slot each new token's KV is written to.
        seq_lens: int64 ``[B]`` sequence length after this step (prefix + new).
        extend_prefix_lens: int64 ``[B]`` tokens already in the KV cache (cached or
            computed by an earlier chunk).
        extend_seq_lens: int64 ``[B]`` new tokens per request (DECODE: all ones).
        kv_indices: per request, int64 ``[seq_lens[i]]`` slots of *all* its tokens,
            prefix first, then the new ones (``kv_indices[i][-extend_seq_lens[i]:]``
            equals that request's part of ``out_cache_loc``).
        return_all_logits: when True the runner returns logits for every new token
            (``[T, vocab]``: prompt logprobs, echo, parity tests); otherwise only
            for the last new token of each request (``[B, vocab]``).
        global_num_tokens: under DP attention, every attention-DP rank's token
            count for this step (all-gathered by the scheduler); ``None`` otherwise.
        can_run_graph: DP attention only: every rank agreed (all-reduce MIN in
            ``sync_step``) that this step is DECODE or IDLE everywhere, so the model
            runner may send it through its decode-graph runner (padded to the bucket
            of ``max(global_num_tokens)``). Stays False when the runner has no decode
            graphs (the all-reduce is then skipped). Without DP attention the runner
            looks at ``mode`` alone.
    """

    mode: ForwardMode
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    seq_lens: torch.Tensor
    extend_prefix_lens: torch.Tensor
    extend_seq_lens: torch.Tensor
    kv_indices: list[torch.Tensor] = field(default_factory=list)
    return_all_logits: bool = False
    global_num_tokens: list[int] | None = None
    can_run_graph: bool = False

    @property
    def batch_size(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def idle(cls, device: torch.device | str = "cpu") -> "ForwardBatch":
        """An IDLE batch: zero requests, zero tokens."""
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        return cls(
            mode=ForwardMode.IDLE,
            input_ids=empty,
            positions=empty,
            out_cache_loc=empty,
            seq_lens=empty,
            extend_prefix_lens=empty,
            extend_seq_lens=empty,
        )
