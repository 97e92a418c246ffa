"""Per-worker circuit breaker: closed -> open -> half-open -> closed.

* closed: requests flow; ``failure_threshold`` consecutive failures (each
  within ``window_s`` of the previous one) open the circuit.
* open: no requests for ``timeout_s``; then half-open.
* half-open: requests flow as trials; ``success_threshold`` successes close
  the circuit, any failure opens it again.

Parameter names and defaults follow sglang-router's ``--cb-*`` flags.  Only
worker faults count as failures (connection errors, timeouts, 5xx but 503); a
4xx is the client's fault and counts as a success; a 429 or 503 ("busy") is
recorded as neither (the proxy does not call the breaker).
"""

from __future__ import annotations

import time

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


class CircuitBreaker:
    """State machine for one worker.  ``clock`` returns seconds (monotonic)."""

    __slots__ = ("failure_threshold", "success_threshold", "timeout_s", "window_s", "enabled",
                 "state", "failures", "successes", "opened_at", "last_failure_at", "clock")

    def __init__(self, failure_threshold: int = 10, success_threshold: int = 3, timeout_s: float = 60.0,
                 window_s: float = 120.0, enabled: bool = True, clock=time.monotonic) -> None:
        self.failure_threshold = max(1, failure_threshold)
        self.success_threshold = max(1, success_threshold)
        self.timeout_s = timeout_s
        self.window_s = window_s
        self.enabled = enabled
        self.clock = clock
        self.state = CLOSED
        self.failures = 0
        self.successes = 0
        self.opened_at = 0.0
        self.last_failure_at = 0.0

    def allows(self) -> bool:
        """True if a request may be sent now (moves open -> half-open when the timeout passed)."""
        if self.state is CLOSED or not self.enabled:
            return True
        if self.state is OPEN:
            if self.clock() - self.opened_at < self.timeout_s:
                return False
            self.state = HALF_OPEN
            self.successes = 0
        return True

    def record_success(self) -> None:
        """A request to the worker completed without a worker fault."""
        if self.state is CLOSED:
            self.failures = 0
            return
        if self.state is HALF_OPEN:
            self.successes += 1
            if self.successes >= self.success_threshold:
                self.state = CLOSED
                self.failures = 0

    def record_failure(self) -> None:
        """A request to the worker failed by the worker's fault."""
        if not self.enabled:
            return
        now = self.clock()
        if self.state is HALF_OPEN:
            self._open(now)
            return
        if self.failures and now - self.last_failure_at > self.window_s:
            self.failures = 0
        self.failures += 1
        self.last_failure_at = now
        if self.state is CLOSED and self.failures >= self.failure_threshold:
            self._open(now)

    def _open(self, now: float) -> None:
        self.state = OPEN
        self.opened_at = now
        self.failures = 0
        self.successes = 0
