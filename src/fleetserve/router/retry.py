"""Retry delays: exponential backoff with jitter.

delay(attempt) = min(initial * multiplier**(attempt-1), max) * (1 + U(-jitter, +jitter)),
for attempt = 1, 2, ... (the wait *before* retry number ``attempt``), in seconds.
Names and defaults follow sglang-router's ``--retry-*`` flags.
"""

from __future__ import annotations

import random


def backoff_delay_s(attempt: int, initial_ms: float = 50.0, max_ms: float = 30000.0, multiplier: float = 1.5,
                    jitter: float = 0.2, rng: random.Random | None = None) -> float:
    """Seconds to wait before retry ``attempt`` (>= 1).  Raises ``ValueError`` for attempt < 1."""
    if attempt < 1:
        raise ValueError(f"attempt must be >= 1, got {attempt}")
    base = min(initial_ms * multiplier ** (attempt - 1), max_ms)
    if jitter:
        base *= 1.0 + (rng or random).uniform(-jitter, jitter)
    return max(0.0, base) / 1000.0
