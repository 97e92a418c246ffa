"""The DP controller: which data-parallel rank serves each request.

One instance has ``dp_size`` schedulers with their own waiting queue (DP
attention groups, or independent replicas without DP attention). The HTTP
process asks :meth:`DPController.assign` for a rank before it sends a
tokenized request, and reports progress back so the loads stay current.

Methods (``--load-balance-method``, SGLang's names):

* ``round_robin``: ranks in turn.
* ``shortest_queue``: the rank with the fewest *running plus waiting tokens*,
  i.e. the sum over its unfinished requests of prompt tokens plus tokens
  generated so far (the KV the rank holds or will hold for them). Ties go to
  the rank that has waited longest since its last assignment, so equal loads
  still spread out.

A request may name its rank (SGLang's ``routed_dp_rank``, vLLM's
``X-data-parallel-rank`` header): it goes there whatever the method says, its
tokens count on that rank, and, as in SGLang's controller, it does not move
the round-robin turn.

The controller only counts what passed through it; :meth:`observe_load`
lets a scheduler's own report (e.g. ``SchedulerStats``) override a rank's
figure when it is known better (cached prefixes, retractions).
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

METHODS = ("round_robin", "shortest_queue")


@dataclass
class _Req:
    rank: int
    tokens: int


class DPController:
    """Assigns requests to ``dp_size`` ranks (thread-safe).

    Args:
        dp_size: number of ranks with their own queue (>= 1).
        method: ``round_robin`` or ``shortest_queue``.

    Raises:
        ValueError: unknown method or ``dp_size < 1``.
    """

    def __init__(self, dp_size: int, method: str = "round_robin"):
        if dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {dp_size}")
        if method not in METHODS:
            raise ValueError(f"--load-balance-method must be one of {METHODS}, got {method!r}")
        self.dp_size = dp_size
        self.method = method
        self._reqs: dict[str, _Req] = {}
        self._load = [0] * dp_size          # running + waiting tokens per rank
        self._num_reqs = [0] * dp_size
        self._last_pick = [-1] * dp_size    # assignment counter at each rank's last pick
        self._counter = itertools.count()
        self._rr = 0
        self._lock = threading.Lock()

    # ------------------------------------------------------------- decisions
    def assign(self, rid: str, num_prompt_tokens: int, routed_rank: int | None = None) -> int:
        """Choose the rank for request ``rid`` and count its prompt on that rank.

        Args:
            routed_rank: the rank the request names (None: the method decides).

        Raises:
            ValueError: ``rid`` is already assigned and unfinished, or ``routed_rank``
                is outside ``[0, dp_size)``.
        """
        with self._lock:
            if rid in self._reqs:
                raise ValueError(f"request {rid!r} is already assigned to rank {self._reqs[rid].rank}")
            if routed_rank is not None:
                if not 0 <= routed_rank < self.dp_size:
                    raise ValueError(f"routed_dp_rank={routed_rank} out of range [0, {self.dp_size})")
                rank = int(routed_rank)
            elif self.method == "round_robin":
                rank = self._rr
                self._rr = (self._rr + 1) % self.dp_size
            else:
                rank = min(range(self.dp_size), key=lambda r: (self._load[r], self._last_pick[r], r))
            self._last_pick[rank] = next(self._counter)
            self._reqs[rid] = _Req(rank, int(num_prompt_tokens))
            self._load[rank] += int(num_prompt_tokens)
            self._num_reqs[rank] += 1
            return rank

    def rank_of(self, rid: str) -> int | None:
        """The rank serving ``rid`` (``None`` once finished or never assigned); aborts go there."""
        with self._lock:
            r = self._reqs.get(rid)
            return None if r is None else r.rank

    # ------------------------------------------------------------- feedback
    def on_tokens(self, rid: str, num_new_tokens: int, finished: bool = False) -> None:
        """``rid`` generated ``num_new_tokens`` more; when ``finished`` its tokens leave the load."""
        with self._lock:
            r = self._reqs.get(rid)
            if r is None:
                return
            if finished:
                self._load[r.rank] = max(0, self._load[r.rank] - r.tokens)
                self._num_reqs[r.rank] -= 1
                del self._reqs[rid]
            else:
                r.tokens += int(num_new_tokens)
                self._load[r.rank] += int(num_new_tokens)

    def on_finished(self, rid: str) -> None:
        """``rid`` finished, failed or was aborted."""
        self.on_tokens(rid, 0, finished=True)

    def observe_load(self, rank: int, tokens: int) -> None:
        """Replace rank ``rank``'s load with a figure the scheduler reported."""
        with self._lock:
            self._load[rank] = int(tokens)

    # ----------------------------------------------------------------- views
    def loads(self) -> list[int]:
        """Running plus waiting tokens per rank."""
        with self._lock:
            return list(self._load)

    def num_requests(self) -> list[int]:
        """Unfinished requests per rank."""
        with self._lock:
            return list(self._num_reqs)

