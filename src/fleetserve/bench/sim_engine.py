"""The simulated engine behind one sim-worker: real radix cache, modelled time.

It schedules like our engine (and SGLang): a FIFO waiting queue; each step
either admits new requests and runs one prefill (extend) step over their
uncached tokens, or runs one decode step for every running request. Prefix
reuse and KV capacity use the engine's own
:class:`fleetserve.engine.radix_cache.RadixCache` over a
:class:`~fleetserve.core.kv_pool.TokenSlotAllocator` of
``max_total_tokens`` slots, so hit counts and LRU eviction are the engine's.
Only the *duration* of a step comes from :class:`TimingModel`; the loop sleeps
until ``step start + modelled duration``, so the Python work of the step is
hidden inside the modelled time as long as the CPU keeps up. ``stats["late_s"]``
sums the wall time steps ran past their modelled end (CPU starved, or Python
work longer than the step): a run is faithful while it is a small share of
``stats["busy_time_s"]``.

Cache semantics per request (those of the engine's scheduler,
``fleetserve.engine.scheduler``):

* waiting requests are ordered longest-cached-prefix first (``lpm``) while the
  queue holds at most 128, else first come first served;
* match ``input_ids[:-1]`` (the last prompt token is always computed, so at
  least one token is prefilled); ``cached_tokens`` = matched length;
* a request sharing at least ``min(32, uncached - 1)`` uncached tokens with one
  already in this prefill batch waits one step, to reuse that prefill (the engine's
  ``defer_for_in_batch_share``: none waits that has only its last token to compute, so
  ``n`` samples of one prompt take one full prefill, then one step for the other ``n - 1``);
* lock the matched node, reserve ``uncached + max_new_tokens`` KV slots,
  evicting LRU leaves when the allocator is short; if it is still short the
  request waits until running requests finish (the engine reserves only an
  estimate of the output and retracts on overflow; reserving it all keeps the
  simulation free of retraction);
* right after the prefill step the prompt goes into the tree (locked), so
  concurrent requests with the same prefix hit it while this one decodes;
* on finish, insert ``input_ids + output_ids[:-1]`` (the tokens whose KV was
  computed), free duplicate and unused slots, unlock.

With ``page_size > 1`` (``--page-size``) slots come in whole pages, matches
are rounded down to whole pages and the tree takes only whole pages: a
request's partial last page (prompt tail, then outputs) stays its own and is
freed when it finishes, as in the engine.

Failure: if a step raises (a bug, or input no check caught), the loop stops for
good as a crashed scheduler does: :attr:`SimEngine.error` names the exception,
every queued, prefilling and running request ends with ``SimRequest.error`` set
(its events end), and :meth:`SimEngine.submit` refuses new ones with
:class:`SimEngineError`, so the worker answers 503 and ``/health`` fails
instead of hanging every request after the one that broke it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from fleetserve.bench.timing_model import TimingModel
from fleetserve.engine.io_struct import SchedulerStats
from fleetserve.engine.load_report import ThroughputMeter
from fleetserve.engine.radix_cache import RadixCache
from fleetserve.engine.schedule_policy import LPM_MAX_QUEUE, defer_for_in_batch_share

log = logging.getLogger(__name__)


class RequestTooLong(ValueError):
    """The prompt plus ``max_new_tokens`` cannot fit in the KV pool."""


class SimEngineError(RuntimeError):
    """The engine's loop failed (see :attr:`SimEngine.error`): it takes no request and finishes none."""


@dataclass
class SimRequest:
    """One request inside the simulated engine.

    ``events`` receives ``(new_ids, new_pieces, finished)`` tuples: the first
    token alone right after prefill, then every ``stream_interval`` tokens,
    and the rest at the end.
    """

    rid: str
    input_ids: list[int]
    max_new_tokens: int
    output_ids: list[int]
    output_pieces: list[str]
    stream_interval: int = 1
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.monotonic)
    cached_tokens: int = 0
    generated: int = 0
    sent: int = 0
    aborted: bool = False
    finished: bool = False
    error: str | None = None  # set (with a last, finishing event) when the engine's loop failed
    _node: object = None
    _prefix_slots: torch.Tensor | None = None
    _own_slots: torch.Tensor | None = None


class SimEngine:
    """Scheduler loop of one simulated instance.

    Args:
        model: the timing model (and the capacities).
        name: worker identity reported in responses and stats.
        event_sink: the radix cache's KV-event sink (``--kv-events-config``: a
            :class:`~fleetserve.engine.kv_events.publisher.KVEventPublisher`); its
            ``end_step()`` is called once per step and after a cache flush.
    """

    def __init__(self, model: TimingModel, name: str = "sim", event_sink=None):
        self.model = model
        self.name = name
        self.event_sink = event_sink
        self.cache = RadixCache(model.max_total_tokens, page_size=model.page_size, event_sink=event_sink)
        self.allocator = self.cache.allocator
        self.capacity = self.allocator.size  # whole pages of max_total_tokens
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.stats = {"num_requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "generation_tokens": 0,
                      "num_prefill_steps": 0, "num_decode_steps": 0, "busy_time_s": 0.0, "late_s": 0.0}
        self.gen_meter = ThroughputMeter()
        self.prefill_meter = ThroughputMeter()  # uncached prompt tokens, for /v1/loads prefill_throughput
        self.idle = False  # True while the loop waits for work (nothing queued, running or in a prefill step)
        self.prefilling: list[SimRequest] = []  # admitted, in the current prefill step
        self.error: str | None = None  # what stopped the loop, once it failed

    # ------------------------------------------------------------------ API
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"sim-engine-{self.name}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        if self.event_sink is not None and hasattr(self.event_sink, "shutdown"):
            self.event_sink.shutdown()

    def submit(self, req: SimRequest) -> None:
        """Queue ``req``.

        Raises:
            RequestTooLong: it can never fit.
            SimEngineError: the loop has failed.
        """
        if self.error is not None:
            raise SimEngineError(f"the simulated engine {self.name!r} stopped: {self.error}")
        if len(req.input_ids) + req.max_new_tokens > self.capacity:
            raise RequestTooLong(f"prompt ({len(req.input_ids)} tokens) + max_tokens ({req.max_new_tokens}) "
                                 f"exceeds the KV capacity ({self.capacity} tokens)")
        if not req.input_ids:
            raise ValueError("empty prompt")
        self.waiting.append(req)
        self.idle = False
        self._wake.set()

    def abort(self, req: SimRequest) -> None:
        """The client went away: drop ``req`` at the next step."""
        req.aborted = True
        self.idle = False
        self._wake.set()

    def flush_cache(self) -> bool:
        """Empty the radix cache; ``False`` (nothing done) while requests are queued or running."""
        if self.waiting or self.running:
            return False
        self.cache.reset()
        self._end_step()
        return True

    def _end_step(self) -> None:
        end = getattr(self.event_sink, "end_step", None)
        if end is not None:
            end()

    def load(self) -> dict:
        return {"num_running_reqs": len(self.running), "num_waiting_reqs": len(self.waiting),
                "cache_tokens": self.cache.total_size(), "free_kv_tokens": self.allocator.available_size()}

    def scheduler_stats(self) -> SchedulerStats:
        """This worker's figures as an engine scheduler reports them (DP rank 0), for ``/v1/loads``,
        ``/get_load`` (shaped by :mod:`fleetserve.entrypoints.load_view`, as the engine's are).

        ``kv_used_tokens``: pool minus free minus evictable cached slots (the engine's
        formula; here it includes the output slots a running request reserved).
        ``num_waiting_uncached_tokens``: each waiting prompt minus its cached prefix
        (matched as admission matches it, ``input_ids[:-1]``).
        """
        matched = [int(self.cache.match_prefix(r.input_ids[:-1])[0].numel()) for r in self.waiting]
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_pool_size=self.capacity,
            kv_used_tokens=self.capacity - self.allocator.available_size() - self.cache.evictable_size(),
            kv_cached_tokens=self.cache.total_size(),
            prompt_tokens_total=self.stats["prompt_tokens"],
            generation_tokens_total=self.stats["generation_tokens"],
            cached_prompt_tokens_total=self.stats["cached_tokens"],
            kv_events_published=int(getattr(self.event_sink, "published", 0)),
            kv_events_dropped=int(getattr(self.event_sink, "dropped", 0)),
            num_waiting_uncached_tokens=sum(len(r.input_ids) - m for r, m in zip(self.waiting, matched)),
            num_pending_tokens=sum(len(r.input_ids) for r in self.waiting),
            max_running_requests=self.model.max_running_requests,
            gen_throughput=self.gen_meter.rate(),
            prefill_throughput=self.prefill_meter.rate(),
            timestamp=time.time(),
        )

    # ------------------------------------------------------------- scheduling
    async def _run(self) -> None:
        """:meth:`_loop`, and on its failure: record it, end every request it held (see the module doc)."""
        try:
            await self._loop()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 -- any failure stops the engine; say so rather than hang
            self.error = f"{type(e).__name__}: {e}"
            log.exception("simulated engine %r stopped", self.name)
            held = {id(r): r for r in [*self.waiting, *self.prefilling, *self.running]}
            self.waiting.clear()
            self.prefilling, self.running = [], []
            for r in held.values():
                if not r.finished:
                    r.error, r.finished = self.error, True
                    r.events.put_nowait(([], [], True))

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if self._drop_aborted():
                self._end_step()  # their pages entered the tree; publish now, the loop may go idle
            if not self.waiting and not self.running:
                self._wake.clear()
                self.idle = True
                await self._wake.wait()
                self.idle = False
                continue
            t0 = loop.time()
            new = self.prefilling = self._admit()
            if new:
                uncached = sum(len(r.input_ids) - r.cached_tokens for r in new)
                dur = self.model.prefill_time(uncached)
                self.stats["num_prefill_steps"] += 1
                await self._sleep_until(loop, t0 + dur)
                for r in new:
                    self._cache_prompt(r)
                    self._emit(r, 1)
                self.running.extend(r for r in new if not r.finished)
                self.prefilling = []
            elif self.running:
                ctx = sum(len(r.input_ids) + r.generated for r in self.running)
                dur = self.model.decode_time(len(self.running), ctx)
                self.stats["num_decode_steps"] += 1
                await self._sleep_until(loop, t0 + dur)
                for r in self.running:
                    self._emit(r, 1)
                self.running = [r for r in self.running if not r.finished]
            else:
                # head of the queue does not fit and nothing runs: cannot happen after
                # the submit() size check unless the cache is locked by nobody; wait a tick.
                self._end_step()  # evictions made while trying to admit are published all the same
                await asyncio.sleep(0.001)
                continue
            self.stats["busy_time_s"] += dur
            # wall time past the modelled end of the step (the loop or the CPU could not keep up): the
            # simulation is faithful only while this stays a small share of busy_time_s
            self.stats["late_s"] += max(0.0, loop.time() - (t0 + dur))
            self.gen_meter.record(self.stats["generation_tokens"])
            self.prefill_meter.record(self.stats["prompt_tokens"] - self.stats["cached_tokens"])
            self._end_step()

    @staticmethod
    async def _sleep_until(loop: asyncio.AbstractEventLoop, deadline: float) -> None:
        delay = deadline - loop.time()
        await asyncio.sleep(delay if delay > 0 else 0)

    def _admit(self) -> list[SimRequest]:
        """Take waiting requests (lpm order) while slots, KV and the prefill budget allow."""
        new: list[SimRequest] = []
        self.prefilling = new  # so a failure part way leaves none of them unaccounted for (_run)
        budget = self.model.chunked_prefill_size
        if 1 < len(self.waiting) <= LPM_MAX_QUEUE:
            lens = {id(r): int(self.cache.match_prefix(r.input_ids[:-1])[0].numel()) for r in self.waiting}
            self.waiting = deque(sorted(self.waiting, key=lambda r: (-lens[id(r)], r.arrival)))
        skipped: list[SimRequest] = []
        try:
            while self.waiting and len(self.running) + len(new) < self.model.max_running_requests:
                r = self.waiting[0]
                slots, node = self.cache.match_prefix(r.input_ids[:-1])
                cached = int(slots.numel())
                uncached = len(r.input_ids) - cached
                if new:
                    if defer_for_in_batch_share(r.input_ids, cached, [q.input_ids for q in new]):  # the engine's rule
                        skipped.append(self.waiting.popleft())  # reuse that prefill next step
                        continue
                    if uncached > budget:
                        break
                self.cache.inc_lock_ref(node)
                need = uncached + r.max_new_tokens
                short = need + (-need) % self.allocator.page_size - self.allocator.available_size()
                if short > 0:
                    self.cache.evict(short)
                own = self.allocator.alloc(need)
                if own is None:
                    self.cache.dec_lock_ref(node)
                    break
                self.waiting.popleft()
                r.cached_tokens, r._node, r._prefix_slots, r._own_slots = cached, node, slots, own
                self.stats["num_requests"] += 1
                self.stats["prompt_tokens"] += len(r.input_ids)
                self.stats["cached_tokens"] += cached
                budget -= uncached
                new.append(r)
        finally:  # deferred ones go back to the front, even if a step above raised
            self.waiting.extendleft(reversed(skipped))
        return new

    def _cache_prompt(self, r: SimRequest) -> None:
        """After the prefill step: put the prompt's KV in the tree, move the lock down to it."""
        n_prompt = len(r.input_ids) - r.cached_tokens
        own_prompt = r._own_slots[:n_prompt]
        all_slots = torch.cat([r._prefix_slots, own_prompt])
        n_present = self.cache.insert(r.input_ids, all_slots)
        if n_present > r.cached_tokens:  # someone inserted part of it meanwhile: keep the tree's slots
            self.allocator.free(own_prompt[:n_present - r.cached_tokens])
        tree_slots, node = self.cache.match_prefix(r.input_ids)
        self.cache.inc_lock_ref(node)
        self.cache.dec_lock_ref(r._node)
        r._node, r._prefix_slots = node, tree_slots
        # what is left: a partial last prompt page (paging), then the output's reserved slots
        r._own_slots = r._own_slots[int(tree_slots.numel()) - r.cached_tokens:]

    def _emit(self, r: SimRequest, n: int) -> None:
        n = min(n, r.max_new_tokens - r.generated)  # max_new_tokens 0 (SGLang's /generate allows it): none
        r.generated += n
        self.stats["generation_tokens"] += n
        done = r.generated >= r.max_new_tokens
        if done or r.generated == 1 or r.generated - r.sent >= r.stream_interval:
            ids = r.output_ids[r.sent:r.generated]
            pieces = r.output_pieces[r.sent:r.generated]
            r.sent = r.generated
            r.events.put_nowait((ids, pieces, done))
        if done:
            self._release(r)

    def _release(self, r: SimRequest) -> None:
        """Hand the request's computed KV to the radix cache and free the rest.

        Called after :meth:`_cache_prompt`: the tree already holds the prompt's
        whole pages (``r._prefix_slots``), ``r._own_slots`` are the slots of the
        tokens after them (a partial prompt page, then the output's reservation).
        """
        r.finished = True
        n_out = max(r.generated - 1, 0)  # output tokens whose KV was computed
        own = r._own_slots
        tokens = r.input_ids + r.output_ids[:n_out]
        base = int(r._prefix_slots.numel())
        n_present = self.cache.insert(tokens, torch.cat([r._prefix_slots, own[:len(tokens) - base]]))
        if n_present > base:
            self.allocator.free(own[:n_present - base])
        kept = self.cache.page_aligned(len(tokens)) - base  # own slots the tree now holds (from n_present on)
        if own.numel() > kept:
            self.allocator.free(own[kept:])
        self.cache.dec_lock_ref(r._node)
        r._own_slots = r._prefix_slots = r._node = None

    def _drop_aborted(self) -> bool:
        """Drop aborted requests; ``True`` when running ones gave their KV to the tree."""
        if any(r.aborted for r in self.waiting):
            self.waiting = deque(r for r in self.waiting if not r.aborted)
        gone = [r for r in self.running if r.aborted and not r.finished]
        if gone:
            for r in gone:
                self._release(r)
            self.running = [r for r in self.running if not r.finished]
        return bool(gone)
