"""Every message between the HTTP process and the scheduler process(es).

The HTTP process tokenizes, sends :class:`TokenizedGenerateReq`; each scheduler
step answers with one :class:`BatchTokenOut` carrying, per request, the tokens
generated since the last message. The scheduler ends a request on EOS, a stop
token id, its length limit or an abort. Everything about text happens on the
detokenizing side (the HTTP process, or the offline ``fleetserve.Engine``):
incremental UTF-8 safe detokenization and stop strings. When that side finds a
stop string it ends the request for its client and sends :class:`AbortReq` so
the scheduler stops generating and frees the request's KV.
:class:`FlushCacheReq` and :class:`GetStatsReq` travel the same way; :class:`FlushCacheOut` and
:class:`SchedulerStats` answer them. On the wire each message is a small header
frame and the pickled message (:mod:`fleetserve.engine.io_frames`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fleetserve.engine.sampling_params import SamplingParams


@dataclass
class TokenizedGenerateReq:
    """One generation request (one sample; ``n > 1`` arrives as ``n`` requests
    sharing a prompt, which the radix cache turns into one prefill).

    Attributes:
        rid: unique request id.
        input_ids: prompt token ids, each in ``[0, vocab_size)``.
        sampling: validated sampling parameters.
        return_logprob: return the chosen tokens' logprobs.
        top_logprobs_num: also return this many top alternatives per position.
        logprob_start_len: first prompt position to return logprobs for
            (``-1``: none; ``0``: the whole prompt, as for OpenAI ``echo``).
        stream: send tokens as they are generated (else only at the end).
        routed_dp_rank: the DP rank that must serve it (SGLang's ``routed_dp_rank``,
            vLLM's ``X-data-parallel-rank``), checked against ``dp_size`` by the HTTP side;
            None: the DP controller chooses.
    """

    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    stream: bool = False
    routed_dp_rank: int | None = None


@dataclass
class AbortReq:
    rid: str


@dataclass
class FlushCacheReq:
    pass


@dataclass
class GetStatsReq:
    pass


@dataclass
class FlushCacheOut:
    """Answer to :class:`FlushCacheReq`: False while requests are queued or running."""

    success: bool
    dp_rank: int = 0


@dataclass
class ReqOutput:
    """What one request produced since the previous message.

    Attributes:
        rid: request id.
        new_token_ids: tokens generated since the last message.
        finished: this is the request's last message.
        finish_reason: ``{"type": "stop", "matched": <token id>}``,
            ``{"type": "length", "length": n}``, ``{"type": "abort", "message": ...}``; ``None`` while running.
        prompt_tokens / completion_tokens / cached_tokens: counts so far
            (``cached_tokens``: prompt tokens served from the radix cache).
        output_logprobs: per new token, ``(logprob, token_id)``.
        output_top_logprobs: per new token, list of ``(logprob, token_id)``, best first.
        input_logprobs / input_top_logprobs: prompt logprobs from ``logprob_start_len``
            (first position has logprob ``None``), sent once with the first message.
    """

    rid: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: dict[str, Any] | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    output_logprobs: list[tuple[float, int]] | None = None
    output_top_logprobs: list[list[tuple[float, int]]] | None = None
    input_logprobs: list[tuple[float | None, int]] | None = None
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None


@dataclass
class BatchTokenOut:
    outputs: list[ReqOutput] = field(default_factory=list)


@dataclass
class SchedulerStats:
    """A scheduler's gauges and counters (for /metrics, /get_server_info, /v1/loads, /get_load).

    Token figures are in tokens (KV slots). ``kv_used_tokens``: held by running
    requests (SGLang's ``num_used_tokens``); ``num_waiting_uncached_tokens``,
    ``num_pending_tokens`` and ``gen_throughput`` (tokens/s): see
    :mod:`fleetserve.engine.load_report`.
    """

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_pool_size: int = 0
    kv_used_tokens: int = 0
    kv_cached_tokens: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    cached_prompt_tokens_total: int = 0
    kv_bytes_per_token: int = 0
    kv_events_published: int = 0  # KV-event batches sent (--kv-events-config), since start
    kv_events_dropped: int = 0  # KV-event batches dropped on a full queue, since start
    dp_rank: int = 0
    num_waiting_uncached_tokens: int = 0
    num_pending_tokens: int = 0
    max_running_requests: int = 0
    gen_throughput: float = 0.0
    prefill_throughput: float = 0.0  # uncached prompt tokens/s (see load_report), SGLang's field
    timestamp: float = 0.0  # when these figures were taken: time.time(), seconds since the epoch (SGLang's)
