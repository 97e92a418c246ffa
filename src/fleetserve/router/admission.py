"""Admission control for the inference routes: a token bucket with a bounded FIFO queue.

The semantics follow smg's / sglang-router's ``--max-concurrent-requests``
limiter (``TokenBucket`` and ``concurrency_limit_middleware`` in smg's
``model_gateway``):

* a bucket of capacity ``N`` (``--max-concurrent-requests``) starts full;
* every admitted request takes one token, and gives it back when its answer
  has ended (streams included) or the client went away;
* the bucket also refills at ``R`` tokens per second
  (``--rate-limit-tokens-per-second``; unset means ``R = N``, as in smg), and
  never holds more than ``N``.  With ``R = 0`` tokens only come back when
  requests end: a pure limit of ``N`` requests at once;
* a request that finds no token waits in a FIFO queue of at most
  ``--queue-size`` requests.  Tokens go to the queue's head first, so a new
  arrival never overtakes a waiting one.

Outcomes (:meth:`Admission.admit` returns ``None`` when admitted, else the
error response):

* queue full (or ``--queue-size 0``): **429** at once, with ``Retry-After``;
* waited ``--queue-timeout-secs`` without a token: **408** (smg answers 408);
* the client disconnected while queued: its handler is cancelled, it leaves
  the queue at once and never reaches a worker.

Differences from smg 1.13 / sglang-router 0.3.2 (both checked by running
them): their 408/429 have an empty body and no ``Retry-After``; ours are
OpenAI-style JSON errors and the 429 carries ``Retry-After``.  Their queue
hands each waiter to a task at once, so ``--queue-size`` does not bound the
number of waiters; ours does.  Their ``--rate-limit-tokens-per-second 0``
means ``R = N``; ours means no refill (the bucket's own ``refill_rate = 0``
case).

Everything runs on the event loop thread: no locks.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import math
import time

from .http.server import Response, json_error

# queue wait histogram bounds, seconds
QUEUE_WAIT_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
REJECT_REASONS = ("queue_full", "queue_timeout", "client_disconnected")


class Admission:
    """Token bucket of ``capacity`` tokens refilled at ``refill_per_s``, with a FIFO queue of ``queue_size``.

    ``capacity`` >= 1, ``refill_per_s`` >= 0 (tokens/s, 0 = tokens come back
    only on :meth:`release`), ``queue_size`` >= 0 waiters, ``queue_timeout_s``
    > 0 seconds.  Call :meth:`admit` before sending a request upstream and,
    only if it returned ``None``, :meth:`release` exactly once when the
    request is over.
    """

    def __init__(self, capacity: int, refill_per_s: float, queue_size: int, queue_timeout_s: float) -> None:
        self.capacity = float(capacity)
        self.refill_per_s = float(refill_per_s)
        self.queue_size = queue_size
        self.queue_timeout_s = queue_timeout_s
        self.tokens = float(capacity)
        self._last = time.monotonic()
        self._waiters: collections.deque[asyncio.Future] = collections.deque()
        self._timer: asyncio.TimerHandle | None = None
        # counters for /metrics
        self.admitted = 0  # requests holding a token now
        self.allowed_total = 0
        self.rejected = dict.fromkeys(REJECT_REASONS, 0)
        self.wait_counts = [0] * (len(QUEUE_WAIT_BUCKETS_S) + 1)
        self.wait_sum = 0.0

    # ------------------------------------------------------------ state
    @property
    def queued(self) -> int:
        """Requests waiting in the queue now."""
        return len(self._waiters)

    def _refill(self) -> None:
        if self.refill_per_s:
            now = time.monotonic()
            self.tokens = min(self.capacity, self.tokens + (now - self._last) * self.refill_per_s)
            self._last = now

    def _take(self) -> bool:
        self._refill()
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False

    # ------------------------------------------------------------ the request path
    def try_admit(self) -> bool:
        """Take a token now if one is free and nobody waits (the fast path: no coroutine, no wait)."""
        if self._waiters:
            return False
        if self.refill_per_s:
            self._refill()
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        self.admitted += 1
        self.allowed_total += 1
        self.wait_counts[0] += 1  # waited 0 s
        return True

    async def admit(self) -> Response | None:
        """Wait for a token: ``None`` once admitted, else the 429 / 408 response to send.

        Raises ``CancelledError`` if the calling task is cancelled while
        queued (the client went away); it has then left the queue and holds
        no token.  Callers on a hot path try :meth:`try_admit` first.
        """
        if self.try_admit():
            return None
        if len(self._waiters) >= self.queue_size:
            self.rejected["queue_full"] += 1
            return self._too_many()
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        t0 = loop.time()
        self._waiters.append(fut)
        timeout = loop.call_later(self.queue_timeout_s, self._expire, fut)
        self._schedule_refill(loop)
        try:
            await fut
        except asyncio.CancelledError:
            timeout.cancel()
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                # the token was handed over just as the client went away: give it back
                self.admitted += 1
                self.release()
            else:
                self._discard(fut)
            self.rejected["client_disconnected"] += 1
            raise
        except _QueueTimeout:
            self.rejected["queue_timeout"] += 1
            return json_error(408, f"request waited {self.queue_timeout_s:g} s in the admission queue "
                                   f"(--queue-timeout-secs) without being admitted", "timeout_error",
                              code="queue_timeout")
        timeout.cancel()
        self._granted(loop.time() - t0)
        return None

    def release(self) -> None:
        """Give back the token of a request that was admitted, and wake the queue's head."""
        self.admitted -= 1
        if self.refill_per_s:
            self._refill()
        tokens = self.tokens + 1.0
        self.tokens = tokens if tokens < self.capacity else self.capacity
        if self._waiters:
            self._hand_out()

    # ------------------------------------------------------------ internals
    def _granted(self, waited_s: float) -> None:
        self.admitted += 1
        self.allowed_total += 1
        self.wait_counts[bisect.bisect_left(QUEUE_WAIT_BUCKETS_S, waited_s)] += 1
        self.wait_sum += waited_s

    def _hand_out(self) -> None:
        """Give tokens to waiters, head first, while there are tokens."""
        waiters = self._waiters
        while waiters:
            head = waiters[0]
            if head.done():  # expired or cancelled, not yet removed
                waiters.popleft()
                continue
            if not self._take():
                break
            waiters.popleft()
            head.set_result(None)
        if waiters:
            self._schedule_refill(asyncio.get_running_loop())

    def _schedule_refill(self, loop: asyncio.AbstractEventLoop) -> None:
        """With a refill rate, wake up when the next token will be there."""
        if not self.refill_per_s or self._timer is not None:
            return
        self._refill()
        delay = max(0.0, (1.0 - self.tokens) / self.refill_per_s)
        self._timer = loop.call_later(delay, self._on_refill_timer)

    def _on_refill_timer(self) -> None:
        self._timer = None
        self._hand_out()

    def _expire(self, fut: asyncio.Future) -> None:
        if not fut.done():
            self._discard(fut)
            fut.set_exception(_QueueTimeout())

    def _discard(self, fut: asyncio.Future) -> None:
        try:
            self._waiters.remove(fut)
        except ValueError:
            pass

    def retry_after_s(self) -> int:
        """Whole seconds a rejected client should wait (``Retry-After``): the time for the queue
        ahead of it to drain at the refill rate, and 1 s without a refill rate (no estimate)."""
        if self.refill_per_s:
            return max(1, math.ceil((len(self._waiters) + 1) / self.refill_per_s))
        return 1

    def _too_many(self) -> Response:
        resp = json_error(429, f"too many requests: {int(self.capacity)} admitted and the admission queue "
                               f"(--queue-size {self.queue_size}) is full", "rate_limit_error",
                          code="rate_limit_exceeded")
        resp.headers = [("Retry-After", str(self.retry_after_s()))]
        return resp


class _QueueTimeout(Exception):
    """Set on a waiter's future when --queue-timeout-secs passes."""


def make_admission(cfg) -> Admission | None:
    """The limiter ``cfg`` asks for, or ``None`` with ``--max-concurrent-requests -1`` (off).

    ``--rate-limit-tokens-per-second`` unset means a refill of N tokens/s, as in smg.
    """
    n = cfg.max_concurrent_requests
    if n is None or n < 1:
        return None
    rate = cfg.rate_limit_tokens_per_second
    return Admission(n, n if rate is None else rate, cfg.effective_queue_size, cfg.effective_queue_timeout_secs)
