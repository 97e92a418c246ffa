"""Which waiting requests to prefill next, and how many fit.

Policies (``--schedule-policy``):

* ``lpm`` (longest prefix match): requests whose prompt has the longest
  prefix in the radix cache go first, so cached KV is reused before it is
  evicted. Falls back to FCFS for queues longer than :data:`LPM_MAX_QUEUE`
  (matching every request each step would cost more than it saves; SGLang
  does the same at 128).
* ``fcfs``: arrival order.

Admission (:class:`PrefillAdder`) is bounded by

* KV: free slots plus evictable cached slots, minus a reserve for the decode
  growth of running requests: ``min(max_new_tokens - generated, CLIP) *
  new_token_ratio`` per request (SGLang's estimate; the ratio starts at
  ``INIT_NEW_TOKEN_RATIO``, decays towards ``MIN_NEW_TOKEN_RATIO`` while decode
  runs smoothly and jumps back up after a retraction);
* ``--max-running-requests``;
* ``--max-prefill-tokens`` new tokens per batch and ``--chunked-prefill-size``
  (a longer prompt is cut; its remainder continues next step as *the* chunked
  request, which always goes first).
"""

from __future__ import annotations

from fleetserve.engine.radix_cache import RadixCache, _common_len
from fleetserve.engine.req import Req

LPM_MAX_QUEUE = 128
CLIP_MAX_NEW_TOKENS = 4096
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001
# A waiting request sharing at least this many uncached tokens with one already
# in the batch waits one step, so that it reuses that request's prefill from
# the radix cache (n > 1 samples of one prompt share one prefill).
IN_BATCH_SHARE_MIN = 32


def sort_waiting(queue: list[Req], policy: str, cache: RadixCache) -> None:
    """Order ``queue`` in place by ``policy`` (see module docstring)."""
    if policy == "lpm" and not cache.disable and 1 < len(queue) <= LPM_MAX_QUEUE:
        lens = {id(r): int(cache.match_prefix(r.fill_ids)[0].numel()) for r in queue}
        queue.sort(key=lambda r: (-lens[id(r)], r.arrival))
    else:
        queue.sort(key=lambda r: r.arrival)


def decode_reserve(req: Req, new_token_ratio: float) -> int:
    """KV tokens to keep free for ``req``'s future output (estimate)."""
    mx = req.sampling.max_new_tokens
    remaining = (req.max_len - req.seq_len) if mx is None else min(mx - len(req.output_ids), req.max_len - req.seq_len)
    return int(max(0, min(remaining, CLIP_MAX_NEW_TOKENS)) * new_token_ratio)


def prefix_limit(req: Req) -> int:
    """Longest prefix the radix cache may supply for ``req``.

    At least the last prompt token is computed (its logits pick the first
    output); prompt logprobs from ``logprob_start_len`` need the logits of the
    position before it, so those positions are recomputed.
    """
    limit = len(req.fill_ids) - 1
    if req.wants_input_logprobs:
        limit = min(limit, max(0, req.logprob_start_len - 1))
    return max(0, limit)


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two token lists."""
    return _common_len(a, 0, b)


def defer_for_in_batch_share(fill: list[int], prefix_len: int, batch_fills: list[list[int]]) -> bool:
    """Should a request wait one step to reuse the prefill of a request already in the batch?

    Yes when the uncached tokens it shares with one of ``batch_fills`` would save
    at least ``min(IN_BATCH_SHARE_MIN, what it must compute minus its last token)``
    tokens of prefill (and at least one).
    """
    if not batch_fills:
        return False
    computable = len(fill) - 1 - prefix_len  # the last token is always computed
    if computable <= 0:
        return False
    shared = max(common_prefix_len(fill, q) for q in batch_fills) - prefix_len
    saved = min(shared, computable)
    return saved > 0 and saved >= min(IN_BATCH_SHARE_MIN, computable)


class PrefillAdder:
    """Budget of one EXTEND batch.

    Args:
        room: KV tokens available to new requests (free + evictable - decode reserve).
        max_prefill_tokens: new tokens allowed in this batch.
        chunk_size: chunked-prefill size, ``None`` for no chunking.
        running_slots: how many more requests may run (``max_running_requests`` - running).
    """

    def __init__(self, room: int, max_prefill_tokens: int, chunk_size: int | None, running_slots: int):
        self.room = room
        self.rem_tokens = max_prefill_tokens
        self.rem_chunk = chunk_size if chunk_size is not None else None
        self.running_slots = running_slots
        self.num_admitted = 0

    def plan(self, extend: int, reserve: int, must_progress: bool) -> int:
        """How many of ``extend`` new tokens this request may compute now (0: stop admitting).

        ``must_progress``: nothing else runs; admit if the chunk alone fits.
        """
        if self.running_slots <= 0 or extend <= 0:
            return 0
        take = extend
        if self.rem_chunk is not None:
            take = min(take, self.rem_chunk)
        if self.num_admitted > 0 and take > self.rem_tokens:
            return 0
        if take <= 0:
            return 0
        chunked = take < extend
        need = take if chunked else take + reserve
        if need > self.room and not (must_progress and self.num_admitted == 0 and take <= self.room):
            return 0
        return take

    def commit(self, take: int, reserve: int, chunked: bool) -> None:
        self.room -= take + (0 if chunked else reserve)
        self.rem_tokens -= take
        if self.rem_chunk is not None:
            self.rem_chunk -= take
        self.running_slots -= 1
        self.num_admitted += 1
