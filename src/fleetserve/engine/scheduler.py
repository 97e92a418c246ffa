"""The per-rank scheduler: continuous batching over a radix prefix cache.

One call to :meth:`Scheduler.step` is one iteration::

    batch = get_next_batch()          # EXTEND (prefill) if anything can be admitted,
                                      # else DECODE of the running requests, else None
    batch = dp_hook(self, batch)      # DP attention: all-gather token counts, IDLE
                                      # batch when this rank has none (see below)
    result = run_batch(batch)         # model forward -> logits
    outputs = process_batch_result(batch, result)   # sample, append, finish, free

Requests enter with :meth:`add_request` and leave with an io_struct
:class:`~fleetserve.engine.io_struct.ReqOutput` whose ``finished`` is True.
The scheduler ends a request on EOS, a stop token id, its length limit or an
abort. It never sees text: stop *strings* belong to the detokenizing side
(:class:`fleetserve.entrypoints.detokenizer.RequestDetokenizer`), which aborts
the request here once it finds one.

KV bookkeeping: each request locks the radix-tree node of its cached prefix.
After every EXTEND its computed tokens are inserted into the tree (so later
requests, and its own next chunk, reuse them) and its lock moves down to the
new node; DECODE tokens stay private until the request finishes, when all its
computed tokens go into the tree (evictable). When DECODE needs more slots
than are free after eviction, the newest running request is *retracted*: its
KV goes to the tree, it returns to the front of the waiting queue with its
output so far, and its next prefill continues exactly where it stopped (its
seeded generator is kept, so sampled outputs are unchanged too).

Paging (``--page-size N``): a request's next tokens take the rest of its last
page before a fresh page (:meth:`Scheduler._alloc_for`, :meth:`Scheduler._decode_loc`);
the tree takes whole pages only, so a partial last page stays the request's
own and is freed when it finishes, is retracted or aborted.

DP attention hook: ``dp_hook(scheduler, batch_or_None) -> batch_or_None`` is
called between batch formation and the forward. Under DP attention it
all-gathers every rank's ``batch.num_tokens`` (0 for None), returns
``ScheduleBatch.idle()`` when this rank has nothing but another rank does,
fills ``batch.forward_batch.global_num_tokens`` / ``can_run_graph``, and returns
``None`` only when every rank is empty. Without it (single rank) a step with
no work does nothing.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from fleetserve.engine.args import ServerArgs
from fleetserve.core.forward_batch import ForwardMode
from fleetserve.engine.grammar import hook as grammar_hook
from fleetserve.engine.io_struct import ReqOutput, SchedulerStats, TokenizedGenerateReq
from fleetserve.engine.load_report import ThroughputMeter, pending_tokens, waiting_uncached_tokens
from fleetserve.engine.radix_cache import RadixCache, check_kv_invariant
from fleetserve.engine.req import Req
from fleetserve.engine.sampler import Sampler, top_logprob_list
from fleetserve.engine.schedule_batch import ScheduleBatch, build_decode, build_extend
from fleetserve.engine.schedule_policy import (
    INIT_NEW_TOKEN_RATIO, MIN_NEW_TOKEN_RATIO, NEW_TOKEN_RATIO_DECAY, PrefillAdder, decode_reserve,
    defer_for_in_batch_share, prefix_limit, sort_waiting,
)

logger = logging.getLogger(__name__)

DEFAULT_MAX_RUNNING_REQUESTS = 1024

DpHook = Callable[["Scheduler", "ScheduleBatch | None"], "ScheduleBatch | None"]


class Scheduler:
    """Continuous-batching scheduler of one rank.

    Args:
        server_args: engine configuration (policy, chunk size, limits, radix on/off).
        model_runner: object with ``forward(ForwardBatch) -> float32 logits``,
            ``allocator`` (:class:`TokenSlotAllocator`), ``vocab_size``,
            ``max_context_len`` and ``eos_token_ids``.
        dp_hook: see the module docstring.
        check_invariants: run :func:`check_kv_invariant` after every step (tests).
        event_sink: receives the radix cache's KV events; when it has ``end_step()``
            (the KV-event publisher) that is called once per step and after a cache flush.
    """

    def __init__(self, server_args: ServerArgs, model_runner: Any, dp_hook: DpHook | None = None,
                 check_invariants: bool = False, event_sink: Any = None):
        self.args = server_args
        self.runner = model_runner
        self.dp_hook = dp_hook
        self.check_invariants = check_invariants
        self.allocator = model_runner.allocator
        self.pool_size = self.allocator.size
        if self.allocator.page_size != server_args.page_size:
            raise ValueError(f"--page-size {server_args.page_size}: the model runner's KV allocator has "
                             f"pages of {self.allocator.page_size}")
        self.page_size = server_args.page_size
        self.cache = RadixCache(self.allocator, disable=server_args.disable_radix_cache, event_sink=event_sink)
        self.event_sink = event_sink
        self.sampler = Sampler(server_args.random_seed)
        self.vocab_size = int(model_runner.vocab_size)
        self.max_context_len = int(server_args.context_length or model_runner.max_context_len)
        self.eos_ids = set(int(t) for t in (getattr(model_runner, "eos_token_ids", None) or []))
        self.max_running = server_args.max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS
        self.chunk_size = server_args.chunk_size
        self.device = getattr(model_runner, "device", "cpu")

        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Req | None = None
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO * server_args.schedule_conservativeness
        self._arrival = itertools.count()
        self.forward_ct = 0
        self.num_retracted = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.cached_prompt_tokens_total = 0
        self.gen_meter = ThroughputMeter()
        self.prefill_meter = ThroughputMeter()  # uncached prompt tokens (prompt - cached), for prefill_throughput
        self._pending_outputs: list[ReqOutput] = []  # finished outside a batch (rare KV aborts)
        self.grammar = grammar_hook.GrammarQueue(self)  # requests waiting for their grammar

    # ================================================================ requests
    def add_request(self, msg: TokenizedGenerateReq | Req) -> list[ReqOutput]:
        """Queue a request. Returns an immediate (finished, abort) output when it cannot run."""
        req = msg if isinstance(msg, Req) else Req.from_tokenized(msg)
        req.arrival = next(self._arrival)
        req.max_len = min(self.max_context_len, self.pool_size)
        problem = None
        if not req.origin_input_ids:
            problem = "the prompt is empty"
        elif len(req.origin_input_ids) >= req.max_len:
            problem = (f"the prompt has {len(req.origin_input_ids)} tokens; the limit is {req.max_len - 1} "
                       f"(context length {self.max_context_len}, KV pool {self.pool_size} tokens)")
        elif any(t < 0 or t >= self.vocab_size for t in req.origin_input_ids):
            bad = next(t for t in req.origin_input_ids if t < 0 or t >= self.vocab_size)
            problem = f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size})"
        if problem is not None:
            req.finish_reason = {"type": "abort", "message": problem}
            return [self._make_output(req)]
        if self.grammar.admit_later(req):
            return []
        self.waiting.append(req)
        return []

    def abort(self, rid: str) -> list[ReqOutput]:
        """Abort request ``rid`` wherever it is; frees its KV. Unknown ids return [].

        Its computed pages enter the radix cache, and their KV events are
        published now: an idle scheduler may not step again for a long time.
        """
        out = self._abort(rid)
        if out:
            self._end_step_events()
        return out

    def _abort(self, rid: str) -> list[ReqOutput]:
        r = self.grammar.remove(rid)
        if r is not None:
            r.finish_reason = {"type": "abort", "message": "aborted"}
            return [self._make_output(r)]
        for i, r in enumerate(self.waiting):
            if r.rid == rid:
                del self.waiting[i]
                self._release(r)
                r.finish_reason = {"type": "abort", "message": "aborted"}
                return [self._make_output(r)]
        for i, r in enumerate(self.running):
            if r.rid == rid:
                del self.running[i]
                self._release(r)
                r.finish_reason = {"type": "abort", "message": "aborted"}
                return [self._make_output(r)]
        if self.chunked_req is not None and self.chunked_req.rid == rid:
            r, self.chunked_req = self.chunked_req, None
            self._release(r)
            r.finish_reason = {"type": "abort", "message": "aborted"}
            return [self._make_output(r)]
        return []

    def flush_cache(self) -> bool:
        """Empty the radix cache; only when no request is queued or running."""
        if self.has_work():
            return False
        self.cache.reset()
        self._end_step_events()
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked_req is not None or self.grammar.pending())

    def get_stats(self) -> SchedulerStats:
        used = self.pool_size - self.allocator.available_size() - self.cache.evictable_size()
        return SchedulerStats(
            num_running_reqs=len(self.running) + (self.chunked_req is not None),
            num_waiting_reqs=len(self.waiting) + self.grammar.pending(),
            kv_pool_size=self.pool_size,
            kv_used_tokens=used,
            kv_cached_tokens=self.cache.total_size(),
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            cached_prompt_tokens_total=self.cached_prompt_tokens_total,
            kv_bytes_per_token=int(getattr(getattr(self.runner, "kv_pool", None), "bytes_per_token", 0) or 0),
            kv_events_published=int(getattr(self.event_sink, "published", 0)),
            kv_events_dropped=int(getattr(self.event_sink, "dropped", 0)),
            num_waiting_uncached_tokens=waiting_uncached_tokens(self.waiting, self.chunked_req, self.cache),
            num_pending_tokens=pending_tokens(self.waiting, self.chunked_req),
            max_running_requests=self.max_running,
            gen_throughput=self.gen_meter.rate(),
            prefill_throughput=self.prefill_meter.rate(),
            timestamp=time.time(),
        )

    # ==================================================================== step
    def step(self) -> list[ReqOutput]:
        """One iteration (see module docstring). Returns the outputs to send."""
        self._pending_outputs += self.grammar.admit_ready()
        batch = self.get_next_batch()
        # ---- DP attention hook: all-gather token counts / IDLE batch ----
        if self.dp_hook is not None:
            batch = self.dp_hook(self, batch)
        # ---------------------------------------------------------------------------
        outputs: list[ReqOutput] = []
        if batch is not None:
            result = self.run_batch(batch)
            outputs = self.process_batch_result(batch, result)
        elif self.grammar.pending():
            self.grammar.wait_idle()  # nothing else to run: wait briefly for a compilation, not spin
        if self._pending_outputs:
            outputs = self._pending_outputs + outputs
            self._pending_outputs = []
        self._end_step_events()
        self.gen_meter.record(self.generation_tokens_total)
        self.prefill_meter.record(self.prompt_tokens_total - self.cached_prompt_tokens_total)
        if self.check_invariants:
            self.check_kv()
        return outputs

    def _end_step_events(self) -> None:
        """Hand this step's KV events to the publisher as one batch (it never waits)."""
        end = getattr(self.event_sink, "end_step", None)
        if end is not None:
            end()

    def get_next_batch(self) -> ScheduleBatch | None:
        """EXTEND if any waiting request (or the chunked one) can be admitted, else DECODE, else None."""
        if self.waiting or self.chunked_req is not None:
            batch = self._schedule_extend()
            if batch is not None:
                return batch
        if self.running:
            return self._schedule_decode()
        return None

    def run_batch(self, batch: ScheduleBatch) -> torch.Tensor | None:
        """Model forward. Returns float32 logits (None for IDLE's result is ignored)."""
        self.forward_ct += 1
        return self.runner.forward(batch.forward_batch)

    def process_batch_result(self, batch: ScheduleBatch, logits: torch.Tensor | None) -> list[ReqOutput]:
        if batch.mode == ForwardMode.IDLE:
            return []
        if batch.mode == ForwardMode.DECODE:
            return self._process_decode(batch, logits)
        return self._process_extend(batch, logits)

    # ============================================================== scheduling
    def _alloc(self, n: int) -> torch.Tensor | None:
        """``n`` free slots (from fresh pages), evicting LRU cached tokens when needed; None if impossible."""
        short = n + (-n) % self.page_size - self.allocator.available_size()
        if short > 0:
            self.cache.evict(short)
        return self.allocator.alloc(n)

    def _alloc_for(self, r: Req, n: int) -> torch.Tensor | None:
        """Slots of ``r``'s next ``n`` tokens: the rest of its last page first (paging), then fresh pages."""
        if self.page_size == 1:
            return self._alloc(n)
        short = self.allocator.tokens_needed(r.num_kv, n) - self.allocator.available_size()
        if short > 0:
            self.cache.evict(short)
        last = int(r.kv_slots[r.num_kv - 1]) if r.num_kv else 0
        return self.allocator.alloc_extend(r.num_kv, last, n)

    def _decode_loc(self) -> torch.Tensor | None:
        """One slot per running request (paging: in its last page while it has room); None if short."""
        if self.page_size == 1:
            return self._alloc(len(self.running))
        ps = self.page_size
        num_kv = torch.tensor([r.num_kv for r in self.running], dtype=torch.int64)
        loc = torch.tensor([int(r.kv_slots[r.num_kv - 1]) for r in self.running], dtype=torch.int64) + 1
        fresh = num_kv % ps == 0
        k = int(fresh.sum())
        if k:
            short = k * ps - self.allocator.available_size()
            if short > 0:
                self.cache.evict(short)
            pages = self.allocator.alloc_pages(k)
            if pages is None:
                return None
            loc[fresh] = pages * ps
        return loc

    def _schedule_extend(self) -> ScheduleBatch | None:
        reserve_running = sum(decode_reserve(r, self.new_token_ratio) for r in self.running)
        room = self.allocator.available_size() + self.cache.evictable_size() - reserve_running
        adder = PrefillAdder(room, self.args.max_prefill_tokens, self.chunk_size,
                             self.max_running - len(self.running))
        reqs: list[Req] = []
        prefix_lens: list[int] = []
        extend_lens: list[int] = []
        done: list[bool] = []

        # 1. the chunked request continues first, whatever else happens
        if self.chunked_req is not None:
            r = self.chunked_req
            p = r.num_kv
            extend = len(r.fill_ids) - p
            take = extend if self.chunk_size is None else min(extend, self.chunk_size)
            slots = self._alloc_for(r, take)
            while slots is None and self.running:
                self._retract(self._pick_retract())
                slots = self._alloc_for(r, take)
            if slots is None:  # cannot happen while prompts fit the pool; stay safe
                self.chunked_req = None
                self._release(r)
                r.finish_reason = {"type": "abort", "message": "KV cache too small for this prompt"}
                self._pending_outputs = [self._make_output(r)]
                return None
            r.append_slots(slots)
            adder.commit(take, 0, take < extend)
            self.chunked_req = r if take < extend else None
            reqs.append(r)
            prefix_lens.append(p)
            extend_lens.append(take)
            done.append(take == extend)

        # 2. waiting requests, in policy order
        if self.waiting:
            sort_waiting(self.waiting, self.args.schedule_policy, self.cache)
        admitted: list[Req] = []
        batch_fills = [r.fill_ids for r in reqs]
        for r in list(self.waiting):
            if adder.running_slots <= 0:
                break
            fill = r.fill_ids
            slots_prefix, node = self.cache.match_prefix(fill[: prefix_limit(r)])
            p = int(slots_prefix.numel())
            extend = len(fill) - p
            if not self.cache.disable and defer_for_in_batch_share(fill, p, batch_fills):
                continue  # wait one step and reuse that request's prefill from the radix cache
            reserve = decode_reserve(r, self.new_token_ratio)
            must_progress = not self.running and not reqs
            take = adder.plan(extend, reserve, must_progress)
            if take == 0:
                break
            chunked = take < extend
            if chunked and self.chunked_req is not None:
                break
            evictable_before = self.cache.evictable_size()
            self.cache.inc_lock_ref(node)
            new = self._alloc(take)
            if new is None:
                self.cache.dec_lock_ref(node)
                break
            adder.room -= evictable_before - self.cache.evictable_size()
            r.reset_kv()
            r.set_tree_prefix(slots_prefix, node)
            r.append_slots(new)
            if not r.prefix_matched:
                r.prefix_matched = True
                r.cached_tokens = p
                self.cached_prompt_tokens_total += p
                self.prompt_tokens_total += len(r.origin_input_ids)
            adder.commit(take, reserve, chunked)
            admitted.append(r)
            if chunked:
                self.chunked_req = r
            batch_fills.append(fill)
            reqs.append(r)
            prefix_lens.append(p)
            extend_lens.append(take)
            done.append(not chunked)
        if admitted:
            ids = {id(r) for r in admitted}
            self.waiting = [r for r in self.waiting if id(r) not in ids]
        if not reqs:
            return None
        all_logits = any(r.wants_input_logprobs for r in reqs)
        batch = build_extend(reqs, prefix_lens, extend_lens, return_all_logits=all_logits, device=self.device)
        batch.prefill_done = done
        return batch

    def _schedule_decode(self) -> ScheduleBatch:
        loc = self._decode_loc()
        while loc is None:
            if len(self.running) > 1:
                self._retract(self._pick_retract())
            elif self.chunked_req is not None:
                self._retract(self.chunked_req)
                self.chunked_req = None
            else:  # one request alone cannot grow: cannot happen since max_len <= pool size
                r = self.running.pop()
                self._release(r)
                r.finish_reason = {"type": "abort", "message": "KV cache too small"}
                self._pending_outputs = [self._make_output(r)]
                return None  # type: ignore[return-value]
            loc = self._decode_loc()
        for i, r in enumerate(self.running):
            r.append_slots(loc[i: i + 1])
        self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        return build_decode(self.running, loc, device=self.device)

    def _pick_retract(self) -> Req:
        """The running request to retract: the most recently arrived one."""
        return max(self.running, key=lambda r: r.arrival)

    def _retract(self, r: Req) -> None:
        """Send ``r`` back to the waiting queue; its KV goes to the radix tree (evictable)."""
        if r in self.running:
            self.running.remove(r)
        self._release(r)
        r.is_retracted = True
        self.waiting.insert(0, r)
        self.num_retracted += 1
        self.new_token_ratio = min(1.0, max(self.new_token_ratio, INIT_NEW_TOKEN_RATIO) + 0.1)
        logger.debug("retracted %s", r.rid)

    # ========================================================== KV ownership
    def _release(self, r: Req) -> None:
        """Give ``r``'s KV away: computed tokens into the radix tree, or freed when disabled."""
        if r.num_kv == 0 and r.last_node is None:
            return
        if self.cache.disable:
            self.allocator.free(r.kv_indices().clone())
        else:
            slots = r.kv_indices().clone()
            n = self.cache.insert(r.fill_ids[: r.num_kv], slots)
            if n > r.num_tree:
                self.allocator.free(slots[r.num_tree: n])
            whole = self.cache.page_aligned(r.num_kv)
            if whole < r.num_kv:  # the partial last page never enters the tree
                self.allocator.free(slots[whole:])
            if r.last_node is not None:
                self.cache.dec_lock_ref(r.last_node)
        r.reset_kv()

    def _cache_unfinished(self, r: Req) -> None:
        """After an EXTEND: move ``r``'s computed tokens into the tree, keep them locked."""
        if self.cache.disable:
            return
        toks = r.fill_ids[: r.num_kv]
        slots = r.kv_indices().clone()
        n = self.cache.insert(toks, slots)
        if n > r.num_tree:
            self.allocator.free(slots[r.num_tree: n])
        tree_slots, node = self.cache.match_prefix(toks)
        self.cache.inc_lock_ref(node)
        if r.last_node is not None:
            self.cache.dec_lock_ref(r.last_node)
        r.set_tree_prefix(tree_slots, node)

    def in_use_slots(self) -> list[torch.Tensor]:
        """Slots owned privately by requests (not in the tree), for invariant checks."""
        reqs = self.running + self.waiting + ([self.chunked_req] if self.chunked_req is not None else [])
        return [r.own_slots() for r in reqs]

    def check_kv(self) -> None:
        """Assert the KV invariant (free + cached + in use == pool, no slot twice).

        With paging also: token ``i`` of every request sits at offset ``i % page_size`` of its page.
        """
        check_kv_invariant(self.allocator, self.cache, self.in_use_slots())
        ps = self.page_size
        if ps > 1:
            for r in self.running + ([self.chunked_req] if self.chunked_req is not None else []):
                kv = r.kv_indices()
                assert bool((kv % ps == torch.arange(r.num_kv) % ps).all()), f"{r.rid}: KV slots off their pages"

    # ============================================================ results
    def _process_extend(self, batch: ScheduleBatch, logits: torch.Tensor) -> list[ReqOutput]:
        reqs = batch.reqs
        if batch.forward_batch.return_all_logits:
            ends = torch.tensor(batch.extend_lens, dtype=torch.int64).cumsum(0) - 1
            self._input_logprobs(batch, logits)
            last = logits[ends]
        else:
            last = logits
        for r in reqs:
            self._cache_unfinished(r)
        rows = [i for i, r in enumerate(reqs) if batch.prefill_done[i]]
        outputs: list[ReqOutput] = []
        to_sample = []
        for i in rows:
            r = reqs[i]
            if r.sampling.max_new_tokens == 0:
                r.finish_reason = {"type": "length", "length": 0}
                self._release(r)
                outputs.append(self._make_output(r))
            else:
                to_sample.append(i)
        if to_sample:
            sub = [reqs[i] for i in to_sample]
            out = self.sampler(last[to_sample] if len(to_sample) != last.shape[0] else last, sub)
            outputs.extend(self._append_tokens(sub, out))
            for r in sub:
                r.is_retracted = False
                if not r.finished:
                    self.running.append(r)
        return outputs

    def _process_decode(self, batch: ScheduleBatch, logits: torch.Tensor) -> list[ReqOutput]:
        out = self.sampler(logits, batch.reqs)
        outputs = self._append_tokens(batch.reqs, out)
        if any(r.finished for r in batch.reqs):
            self.running = [r for r in self.running if not r.finished]
        return outputs

    def _append_tokens(self, reqs: list[Req], out) -> list[ReqOutput]:
        outputs: list[ReqOutput] = []
        interval = self.args.stream_interval
        for i, r in enumerate(reqs):
            tok = out.next_ids[i]
            r.output_ids.append(tok)
            if r.grammar is not None:
                grammar_hook.advance(r, tok)
            if r.return_logprob:
                r.output_logprobs.append(out.logprobs[i])
                r.output_top_logprobs.append(out.top_logprobs[i])
            self._check_finish(r, tok)
            if r.finished:
                self._release(r)
                outputs.append(self._make_output(r))
            elif r.stream:
                r.steps_since_stream += 1
                if r.steps_since_stream >= interval or r.sent_tokens == 0:
                    outputs.append(self._make_output(r))
        self.generation_tokens_total += len(reqs)
        return outputs

    def _check_finish(self, r: Req, tok: int) -> None:
        sp = r.sampling
        if tok in sp.stop_token_ids or (not sp.ignore_eos and tok in self.eos_ids):
            r.finish_reason = {"type": "stop", "matched": tok}
        elif r.grammar is not None and grammar_hook.finished(r):
            r.finish_reason = grammar_hook.finish_reason(r, tok)
        elif sp.max_new_tokens is not None and len(r.output_ids) >= sp.max_new_tokens:
            r.finish_reason = {"type": "length", "length": sp.max_new_tokens}
        elif r.seq_len >= r.max_len:
            r.finish_reason = {"type": "length", "length": len(r.output_ids)}

    def _input_logprobs(self, batch: ScheduleBatch, logits: torch.Tensor) -> None:
        """Prompt logprobs: position ``q`` gets ``log_softmax(logits at q-1)[prompt[q]]``."""
        start = 0
        for r, p, e in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
            if r.wants_input_logprobs:
                prompt = r.origin_input_ids
                first = r.logprob_start_len
                if first == 0 and p == 0:
                    r.input_logprobs.append((None, prompt[0]))
                    r.input_top_logprobs.append(None)
                lo = max(p, first - 1, 0)
                hi = min(p + e, len(prompt) - 1)
                if hi > lo:
                    lp = torch.log_softmax(logits[start + lo - p: start + hi - p].float(), dim=-1)
                    targets = torch.tensor(prompt[lo + 1: hi + 1], dtype=torch.int64)
                    chosen = lp.gather(1, targets.unsqueeze(1)).flatten().tolist()
                    for j, (v, t) in enumerate(zip(chosen, prompt[lo + 1: hi + 1])):
                        r.input_logprobs.append((v, t))
                        r.input_top_logprobs.append(top_logprob_list(lp[j], r.top_logprobs_num))
            start += e

    def _make_output(self, r: Req) -> ReqOutput:
        sent = r.sent_tokens
        new = r.output_ids[sent:]
        o = ReqOutput(
            rid=r.rid, new_token_ids=new, finished=r.finished, finish_reason=r.finish_reason,
            prompt_tokens=len(r.origin_input_ids), completion_tokens=len(r.output_ids),
            cached_tokens=r.cached_tokens,
        )
        if r.return_logprob:
            o.output_logprobs = r.output_logprobs[sent:]
            o.output_top_logprobs = r.output_top_logprobs[sent:]
            if r.logprob_start_len >= 0 and not r.input_logprobs_sent and (r.output_ids or r.finished):
                o.input_logprobs = r.input_logprobs
                o.input_top_logprobs = r.input_top_logprobs
                r.input_logprobs_sent = True
        r.sent_tokens = len(r.output_ids)
        r.steps_since_stream = 0
        return o
