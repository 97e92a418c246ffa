"""Wall time spent inside collectives, per kind, for benchmarks and logs.

Every collective issued through :mod:`fleetserve.distributed` runs inside
``timed(kind)``; on CPU (gloo) the call is synchronous, so the time measured is
the time this rank waited for the collective (including waiting for slower
peers). On CUDA the figure is only the launch time unless the caller
synchronises; benchmarks there should use CUDA events instead.

The counters are process-local and cheap (two ``perf_counter`` calls).
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Iterator

_seconds: dict[str, float] = defaultdict(float)
_calls: dict[str, int] = defaultdict(int)


@contextmanager
def timed(kind: str) -> Iterator[None]:
    """Add the wall time of the ``with`` body to collective ``kind`` (e.g. ``"all_reduce"``)."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        _seconds[kind] += time.perf_counter() - t0
        _calls[kind] += 1


def snapshot() -> dict[str, tuple[int, float]]:
    """``{kind: (calls, seconds)}`` accumulated since the last :func:`reset`."""
    return {k: (_calls[k], _seconds[k]) for k in _seconds}


def total_seconds() -> float:
    """Seconds spent in all collectives since the last :func:`reset`."""
    return float(sum(_seconds.values()))


def reset() -> None:
    _seconds.clear()
    _calls.clear()
