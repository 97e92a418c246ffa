"""What a scheduler reports about its load: the figures behind ``/v1/loads`` and ``/get_load``.

Everything here is read from the scheduler's own state at the moment a
:class:`~fleetserve.engine.io_struct.GetStatsReq` is handled (between two
steps, so never more than one step old):

* ``num_waiting_uncached_tokens``: prompt (plus already generated, for a
  retracted request) tokens of the waiting requests that the radix cache does
  *not* hold now, i.e. the prefill work still ahead, plus what the chunked
  request has left to compute. Each waiting request is matched against the
  radix tree with the same limit the scheduler applies when it admits it
  (:func:`~fleetserve.engine.schedule_policy.prefix_limit`), so the figure
  equals what the next prefills would compute if nothing were evicted first.
  This follows SGLang's ``get_num_waiting_uncached_tokens`` (seqlen minus the
  matched prefix, summed over the waiting queue, plus the chunked request's
  remainder); SGLang reuses the match of its last scheduling pass, we match
  afresh.
* ``num_pending_tokens``: the same requests' full lengths (cached or not), as
  SGLang adds to ``num_used_tokens`` to get ``num_total_tokens``.
* ``gen_throughput``: tokens generated per second over the last
  :data:`THROUGHPUT_WINDOW_S` seconds (:class:`ThroughputMeter`). SGLang logs
  the rate of its last decode logging interval instead; both are tokens/s.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable

from fleetserve.engine.schedule_policy import prefix_limit

THROUGHPUT_WINDOW_S = 5.0


def waiting_uncached_tokens(waiting: list[Any], chunked: Any, cache: Any) -> int:
    """Tokens the waiting requests and the chunked request still have to prefill.

    Args:
        waiting: the scheduler's waiting queue (``Req`` objects).
        chunked: the chunked request (its ``num_kv`` tokens are computed) or None.
        cache: the :class:`~fleetserve.engine.radix_cache.RadixCache`; its
            ``match_prefix`` touches matched nodes for LRU, as the LPM sort does.

    Returns:
        int, >= 0.
    """
    total = 0
    for r in waiting:
        fill = r.fill_ids
        limit = prefix_limit(r)
        matched = int(cache.match_prefix(fill[:limit])[0].numel()) if limit > 0 else 0
        total += max(0, len(fill) - matched)
    if chunked is not None:
        total += max(0, len(chunked.fill_ids) - chunked.num_kv)
    return total


def pending_tokens(waiting: list[Any], chunked: Any) -> int:
    """Full lengths of the waiting requests plus the chunked request's uncomputed tokens."""
    total = sum(len(r.fill_ids) for r in waiting)
    if chunked is not None:
        total += max(0, len(chunked.fill_ids) - chunked.num_kv)
    return total


class ThroughputMeter:
    """Tokens per second over a sliding window, from a running total.

    Call :meth:`record` with the scheduler's ``generation_tokens_total`` after a
    step; :meth:`rate` is ``(total now - total window_s ago) / window_s``, over
    the time since the meter was made while that is shorter than the window.

    Args:
        window_s: window length in seconds (default :data:`THROUGHPUT_WINDOW_S`).
        clock: monotonic seconds (tests pass a fake).
    """

    def __init__(self, window_s: float = THROUGHPUT_WINDOW_S, clock: Callable[[], float] = time.monotonic):
        self.window_s = float(window_s)
        self.clock = clock
        self.start = clock()
        self.samples: deque[tuple[float, int]] = deque([(self.start, 0)])

    def record(self, total: int) -> None:
        """The running total is ``total`` now (a no-op while it has not moved)."""
        if total == self.samples[-1][1]:
            return
        now = self.clock()
        self.samples.append((now, int(total)))
        # Keep one sample at or before the window's start: the total then.
        while len(self.samples) > 1 and self.samples[1][0] <= now - self.window_s:
            self.samples.popleft()

    def rate(self) -> float:
        """Tokens per second over the window ending now (float, >= 0)."""
        now = self.clock()
        edge = now - self.window_s
        base = self.samples[0][1]
        for t, n in self.samples:
            if t <= edge:
                base = n
            else:
                break
        span = min(self.window_s, now - self.start)
        if span <= 0:
            return 0.0
        return max(0.0, (self.samples[-1][1] - base) / span)
