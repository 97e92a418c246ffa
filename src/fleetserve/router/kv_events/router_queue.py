"""kv_aware's router queue (``--router-queue-threshold``): hold requests while every target is busy.

A request routed on arrival to a worker whose queue is already deep waits there for its
prefill, and the decision it was given ages while it waits: the prefix it was sent for may be
evicted before the engine admits it (the engine's pool is full of the running requests' KV, and
a waiting request's cached prefix is the least recently used thing left), so it is computed
again and the queue grows.  Measured at 60 req/s over four simulated workers, that loss cost
kv_aware 5-10 points of hit rate in some runs (docs/benchmarks.md
``routing-kv-rate-evicted-in-queue``).  With this queue the router decides later, when a target
can start the request soon, on what the engines hold then.

A target is **busy** when its queued prefill exceeds ``threshold x budget``:

* queued prefill: the larger of this router's requests there whose prefill has not ended (their
  uncached prompt tokens, ``policy.queued_tokens``) and the engine's own
  ``num_waiting_uncached_tokens`` from ``/v1/loads`` while fresh (:mod:`.loads`), which also
  counts traffic this router never saw;
* budget: the worker's prefill tokens per step from its ``/get_server_info``:
  ``chunked_prefill_size`` (SGLang's field, ours; the simulated worker's too), else
  ``max_num_batched_tokens`` (vLLM's name), else ``max_prefill_tokens``, else
  :data:`DEFAULT_BUDGET`; a whole worker (no ``--dp-aware``) has one budget per DP rank.

While every target of the router's available workers is busy, a new request waits here, first
come first served; a request also waits while others are waiting, so none overtakes.  The head
leaves as soon as one target is not busy, re-checked whenever a queued prefill ends, a request
ends, an engine snapshot arrives, and every :data:`RECHECK_S`; it is then routed at once by the
usual cost.  Heads leave one at a time: the next is checked only after the previous one was
routed and counted.  A request never waits longer than ``max_wait_s`` (then it is routed as is;
counted), and a client that goes away leaves the queue at once.

The flag and its meaning follow NVIDIA Dynamo's KV router (``--router-queue-threshold``: queue
requests while every worker's active prefill tokens exceed this fraction of its batched-token
budget; FCFS by default); the engine-side waiting figure and the budget's sources are ours.  The
rule that a queue is better held centrally while servers are saturated is also the Gateway API
Inference Extension's (its flow control).

Measured on the simulated fleet, it did not pay, and it is off by default (docs/router.md, the
router queue; docs/benchmarks.md ``routing-kv-router-queue``).  The decisions became accurate,
but a request waiting here keeps nothing of its prefix alive, where one waiting in an engine's
queue has it looked up on every scheduling pass.  Over capacity the prefixes were evicted before
the requests left: 33.7-38.6% hit against the default's 48.1% at 64 req/s with 30% direct traffic,
and 6.2% against 29.7% at 90 req/s with all traffic through the router.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time

log = logging.getLogger("fleetserve.router")

DEFAULT_BUDGET = 8192  # tokens per prefill step when a worker reports none (SGLang's chunked_prefill_size default)
RECHECK_S = 0.05  # while requests wait, the busy test is also re-run this often (a snapshot going stale)
_BUDGET_FIELDS = ("chunked_prefill_size", "max_num_batched_tokens", "max_prefill_tokens")


def budget_from_info(info: dict) -> int | None:
    """The prefill tokens per step a ``/get_server_info`` answer reports (see the module docstring),
    None when it reports none (a field that is not a positive int is skipped)."""
    for name in _BUDGET_FIELDS:
        v = info.get(name)
        if type(v) is int and v > 0:
            return v
    return None


class RouterQueue:
    """Requests held in the router while every target is busy (module docstring).

    ``threshold``: the fraction of a target's budget its queued prefill may reach (>= 0; 0 holds
    whenever every target has any queued prefill).  ``max_wait_s`` > 0: the longest a request waits.
    All methods run on the event loop thread.
    """

    def __init__(self, policy, threshold: float, max_wait_s: float = 30.0) -> None:
        self.policy = policy
        self.threshold = threshold
        self.max_wait_s = max_wait_s
        self.budgets: dict[str, int] = {}  # worker url -> prefill tokens per step (budget_from_info)
        self._told: set[str] = set()  # workers whose budget (or its absence) was logged
        self.available = None  # the router's registry.available (app.py): the workers the busy test looks at
        self.workers: list = []  # without it, the worker list of the last decision
        self._waiting: collections.deque = collections.deque()  # futures, in arrival order
        self._leaving = 0  # heads let go whose decision has not been made yet
        self._timer = None
        # for /metrics
        self.held_total = 0  # requests that waited here
        self.wait_seconds_total = 0.0
        self.expired_total = 0  # requests routed because they had waited max_wait_s
        self.gone_total = 0  # requests whose client went away while they waited

    @property
    def pending(self) -> int:
        """Requests waiting now."""
        return len(self._waiting)

    def budget(self, url: str) -> int:
        return self.budgets.get(url, DEFAULT_BUDGET)

    def learned(self, url: str, info: dict) -> None:
        """``url``'s ``/get_server_info`` answer ``info`` arrived: keep its budget (logged when it changes)."""
        budget = budget_from_info(info)
        known = self.budgets.get(url)
        if budget is None:
            self.budgets.pop(url, None)
            if known is not None or url not in self._told:
                log.info("router queue: %s reports no prefill budget (chunked_prefill_size, max_num_batched_tokens, "
                         "max_prefill_tokens): %d tokens per step assumed", url, DEFAULT_BUDGET)
        elif budget != known:
            self.budgets[url] = budget
            log.info("router queue: %s prefill budget %d tokens per step: busy over %.0f queued prefill tokens per "
                     "DP rank", url, budget, self.threshold * budget)
        self._told.add(url)

    def forget(self, url: str) -> None:
        self.budgets.pop(url, None)
        self._told.discard(url)

    def busy(self, url: str, rank: int | None, now: float) -> bool:
        """Whether the target's queued prefill is over ``threshold x budget``."""
        p = self.policy
        queued = p.queued_tokens.get((url, rank), 0)
        loads = p._engine_loads
        if loads is not None and url in loads.snapshots:
            engine = loads.figures(url, rank, now)[1]
            if engine is not None and engine > queued:
                queued = engine
        limit = self.threshold * self.budget(url)
        if rank is None:
            limit *= len(p.ranks(url))
        return queued > limit

    def all_busy(self, now: float | None = None) -> bool:
        """Whether every target is busy: of the router's available workers, else of the last decision's
        (False with no workers known yet)."""
        workers = self.available() if self.available is not None else self.workers
        if not workers:
            return False
        now = time.monotonic() if now is None else now
        p = self.policy
        if p.dp_aware:
            return all(self.busy(w.url, r, now) for w in workers for r in p.ranks(w.url))
        return all(self.busy(w.url, None, now) for w in workers)

    async def wait(self) -> bool:
        """Return when the request may be routed: at once while no request waits and some target is
        not busy, else when it reaches the head and a target is not busy, or after ``max_wait_s``.

        True: it waited, and the caller must call :meth:`routed` once it was routed (or failed before),
        since the next request waits for that.  Cancelled (the client went away): it leaves at once."""
        if not self._waiting and not self._leaving and not self.all_busy():
            return False
        fut = asyncio.get_running_loop().create_future()
        self._waiting.append(fut)
        self.held_total += 1
        t0 = time.monotonic()
        self._arm()
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.max_wait_s)
        except asyncio.TimeoutError:
            if not fut.done():  # routed as it is, as if let go (those behind it keep their order)
                self._waiting.remove(fut)
                fut.cancel()
                self.expired_total += 1
                self._leaving += 1
        except asyncio.CancelledError:  # the client went away
            self.gone_total += 1
            self.wait_seconds_total += time.monotonic() - t0
            if fut.done() and not fut.cancelled():  # it had been let go: the turn passes on
                self._leaving -= 1
            else:
                self._waiting.remove(fut)
                fut.cancel()
            self.pump()
            raise
        self.wait_seconds_total += time.monotonic() - t0
        return True

    def routed(self) -> None:
        """A request that waited here (or just passed) was routed: the next head may go."""
        if self._leaving:
            self._leaving -= 1
        self.pump()

    def pump(self) -> None:
        """Let the head go when no head is still on its way and some target is not busy."""
        if not self._waiting or self._leaving:
            return
        if self.all_busy():
            self._arm()
            return
        fut = self._waiting.popleft()
        fut.set_result(None)
        self._leaving += 1

    def _arm(self) -> None:
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(RECHECK_S, self._tick)

    def _tick(self) -> None:
        self._timer = None
        if self._waiting:
            self.pump()
            if self._waiting:
                self._arm()
