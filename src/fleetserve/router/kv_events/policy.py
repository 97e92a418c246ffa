"""``--policy kv_aware``: route to the lowest cost, from the engines' KV events and token loads.

For each candidate target ``t`` (a worker, or with ``--dp-aware`` one DP rank of a worker)::

    cost(t) = --kv-prefill-weight x (prompt_tokens - cached_tokens(t))
            + --kv-prefill-weight x --kv-queue-weight x queued_prefill_tokens(t)
            + --kv-load-weight    x load_tokens(t)

* ``cached_tokens(t)``: the prompt's prefix ``t`` holds (at most ``prompt[:-1]``:
  engines always compute the last prompt token), by the trust of its
  KV-event stream (:mod:`.subscriber`): ``exact`` -> the event index (plus
  speculative entries); ``degraded`` -> the larger of the index and the
  approximate tree; ``fallback`` -> the approximate tree; in every mode at least
  the prefix (in whole pages) it shares with this router's requests on ``t`` whose
  prefill has not ended (:func:`_pending_prefix`): ``t`` computes that before or
  beside the request, and no event can announce it before that prefill ends (on
  CPU engines a prefill outlasts the speculative TTL).  Two things force
  ``fallback`` whatever the stream's trust, with a reason in the route header:
  ``reason=tokenizer``, the worker counts other prompt tokens than the router
  does (:mod:`.tokenizer_check`), and ``reason=text``, the request has no token
  ids (no ``--tokenizer-path`` and a text prompt), so no event can match it.  Without
  ``--dp-aware`` a worker's value is the best of its ranks (the worker's own
  DP balancer picks the rank).
* ``load_tokens(t)``: this router's in-flight tokens on ``t``: each request
  counts the KV it adds there, its prompt tokens less the ``cached_tokens(t)``
  it was routed on (a prefix shared by requests in flight counts once, as
  the engine holds it once), plus its ``max_tokens`` / ``max_new_tokens``
  (:data:`DEFAULT_DECODE_TOKENS` when absent, at most :data:`MAX_DECODE_TOKENS`)
  from the routing decision until its answer ends; while the engine's own
  ``/v1/loads`` figure is fresh, the larger of the two, the engine's less what
  this router saw end since it was taken (:mod:`.loads`) and less the cached
  prompt tokens of this router's requests it counts (:func:`_held_cached`: the
  engine counts whole prompts, the router only what a request adds).

* ``queued_prefill_tokens(t)``: prefill work ahead of the request on ``t``: the
  uncached prompt tokens (``prompt_tokens - cached_tokens`` at their decision) of
  this router's requests on ``t`` whose prefill has not ended, i.e. from the
  decision until the first answer bytes of a stream arrive (vLLM and SGLang send
  the first chunk with the first token, as our engine does) or until a non-streamed
  answer ends or an engine snapshot shows it admitted (:meth:`KvAwarePolicy.engine_snapshot`,
  from ``num_waiting_reqs``); while the engine's ``/v1/loads`` figure is fresh, the larger of that
  and its ``num_waiting_uncached_tokens`` (less what this router saw prefilled since
  it was taken, :meth:`.loads.EngineLoads.prefilled`).  A queued token costs half
  an uncached token of the request (``--kv-queue-weight`` 0.5): it delays the first
  token as much as one of the request's own, but the request's own uncached tokens
  also delay every request after it on ``t`` and are work the fleet would not
  otherwise do, while the queued ones are computed wherever the request goes (own
  tokens counted twice, for the wait and for the work: queued ones half).  The term
  is NVIDIA Dynamo's KV router's (its ``prefill_tokens`` per worker are the request's
  new tokens plus the worker's active prefill tokens, cleared at the first token);
  Dynamo weighs the two alike, which on 2 engines made requests leave a 520-token
  cached system prompt or a 62-token history to skip a queue of about as many
  tokens (docs/router.md).

With ``--kv-balance-band`` b > 0 (default 0.5; 0: off) the queued-prefill and load terms count only what
``t`` holds over ``(1 + b) x`` the lowest target's figure (:func:`balance_floor`), so that under a
deep, even backlog chance differences between the queues do not outweigh a hit.

With ``--kv-backlog-discount`` d > 0 (default 1; 0: off) the queue weight is divided by
``1 + d x backlog / unit``, ``backlog`` being the least queued prefill over the targets and ``unit``
the mean uncached size of this router's queued requests (:func:`queue_weight_under`), so that
when every target has a backlog (the fleet at or over its capacity) a difference between the queues does not move a request off its cache.

Lowest cost wins, unless the idle rule (:func:`idle_rule`, ``--kv-balance-abs-threshold`` /
``--kv-balance-rel-threshold``) moves the request to an idle target on which it would wait much
less; ties go to the fewest in-flight requests, then to the target this policy
chose least recently (one never chosen first; among those, registration order).  So sequential
new prompts with nothing in flight and nothing cached spread over the workers in turn instead of
all going to the first one (sglang-router's cache_aware spreads such misses to its smallest tree;
its PR #6164 proposed a round-robin tie breaker for the same reason).  The scoring follows NVIDIA Dynamo's KV router (overlap blocks vs.
active blocks, ``kv_overlap_score_weight``) and llm-d's precise prefix-cache
scorer; the weights and units (tokens, not blocks) are ours.

The approximate tree (the router's own record of what it sent, over the token
ids' text form) is updated on every decision in every mode, so a target whose
stream fails is routed as ``cache_aware`` would.  A routed request's full
blocks count as cached on the chosen worker for ``--kv-speculative-ttl-secs``
(speculative entries) from the decision and again from the end of its prefill (when its
events are due), so a burst of one new prefix follows its first request.
Without token ids (no ``--tokenizer-path`` and a text prompt) the request is
routed on its text in the tree, at about 4 characters per token (``branch=fallback
reason=text``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor

from ..body_fields import put_first
from ..radix_tree import RadixTree
from ..route_header import CHARS_PER_TOKEN, HEADER, format_route
from ..routing_text import ids_text
from .index import BlockIndex
from .held import HeldPrefixes
from .pending import QueuedKeys, SortedPrompts, agree_from as _agree_from, one_char_per_id
from .router_queue import RouterQueue
from .subscriber import DEGRADED, EXACT, FALLBACK
from .tokenize import MAX_TOKENIZE_CHARS, RouterTokenizer, request_ids_without_tokenizer, text_size
from .tokenizer_check import TOKENIZER, TokenizerCheck

log = logging.getLogger("fleetserve.router")

SESSION = "session"  # the branch of a request --sticky-sessions sent (route_header.py)
_NONE: dict = {}  # no index match, no queued keys (never written)
_PER_CHAR = 1 / CHARS_PER_TOKEN  # tokens per character of a text prompt matched in the tree
_RANK_0 = (0,)  # the ranks of a worker whose dp_size is not known
_NOTHING_SHARED = (0, ())  # a target none of whose queued prompts shares a token id with the request
TEXT = "text"  # the fallback reason of a request without token ids
DEFAULT_DECODE_TOKENS = 128  # a request without max_tokens counts this many decode tokens
MAX_DECODE_TOKENS = 1024  # a request's decode tokens count at most this much load
KNOWN_AFTER_S = 1.0  # a request sent this long before an engine's figures were taken is in them (engine_snapshot)
IDLE_ABS_THRESHOLD = 160.0  # --kv-balance-abs-threshold: wait gap, in cost units (tokens), before the idle rule moves
IDLE_REL_THRESHOLD = 1.2  # --kv-balance-rel-threshold: wait ratio before the idle rule moves (0: off)
BALANCE_BAND = 0.5  # --kv-balance-band: share over the lowest target's queue / load the balance terms ignore (0: off)
BACKLOG_DISCOUNT = 1.0  # --kv-backlog-discount: how fast a fleet-wide backlog shrinks the queue term (0: off)


class RouteKey:
    """One request's routing input and, after :meth:`KvAwarePolicy.select`, its decision."""

    __slots__ = ("text", "tokens", "prompt_tokens", "decode_tokens", "target", "rank", "branch", "cached",
                 "charged", "queued", "reason", "tokenized", "streamed", "client_rank", "_tree_text", "_one_char",
                 "_chars", "held")

    def __init__(self, text: str, tokens: list[int] | None = None, decode_tokens: int = DEFAULT_DECODE_TOKENS,
                 chars: str | None = None):
        """``chars``: ``tokens`` as one character each (``"".join(map(chr, tokens))``) when the caller has
        them at hand (:meth:`.tokenize.RouterTokenizer.request_ids_chars`), for :meth:`tree_text`."""
        self.text = text
        self.tokens = tokens
        self._chars = chars
        self.prompt_tokens = len(tokens) if tokens is not None else math.ceil(len(text) / CHARS_PER_TOKEN)
        self.decode_tokens = decode_tokens
        self.target = None  # (worker_url, rank or None)
        self.rank = None
        self.branch = None  # exact / degraded / fallback, or session (pin)
        self.cached = 0  # predicted cached prompt tokens on the target
        self.charged = None  # (load key, tokens added to the load, monotonic time of the decision)
        self.queued = 0  # uncached prompt tokens counted as queued prefill on the target until its prefill ends
        self.reason = None  # why the branch is fallback whatever the stream's trust (TOKENIZER, TEXT), or None
        self.tokenized = False  # the ids came from the router's tokenizer (not the request's own ids)
        self.streamed = False  # a stream was asked for: its first answer bytes will tell when its prefill ended
        self.client_rank = None  # the DP rank the client named itself (client_dp_rank), which the engine obeys
        self.held = False  # let go by the router queue and not routed yet (router_queue.py)
        self._tree_text = None
        self._one_char = None

    def tree_text(self) -> str:
        if self._tree_text is None:  # built once: select matches it and _record inserts it
            self._texts()
        return self._tree_text

    def one_char_text(self) -> str | None:
        """:meth:`tree_text` when it has one character per token id after its marker, else None (also
        without ids): see :func:`.pending.one_char_per_id`."""
        if self._tree_text is None:
            self._texts()
        return self._one_char

    def _texts(self) -> None:
        tokens = self.tokens
        if tokens:
            text = self._tree_text = ids_text(tokens, self._chars)
            if len(text) == len(tokens) + 1:
                self._one_char = text
        else:
            self._tree_text = self.text

    def route_header(self) -> str:
        """The ``x-fleetserve-route`` value: ``target=URL; dp_rank=R|-; branch=B; cached_tokens=N; prompt_tokens=M``
        (then ``; reason=R`` when a reason forced ``fallback``)."""
        return format_route(self.target[0], self.rank, self.branch, self.cached, self.prompt_tokens, self.reason)


def client_dp_rank(body: dict, headers: dict | None) -> int | None:
    """The DP rank the client named, as the engine reads it: the ``X-data-parallel-rank`` header first, then
    the body's ``routed_dp_rank``, then SGLang's older ``data_parallel_rank``
    (``entrypoints.validation.resolve_routed_dp_rank``); None when it names none or names it badly (the
    engine answers that with a 400, whatever the router decides)."""
    raw = headers.get("x-data-parallel-rank") if headers else None
    if raw is not None:
        try:
            return int(raw.strip())
        except ValueError:
            return None
    rank = body.get("routed_dp_rank")
    if rank is None:
        rank = body.get("data_parallel_rank")
    return rank if type(rank) is int else None


# the client's own X-data-parallel-rank line, as proxy.py passes it on (name lower case, at a line start)
_CLIENT_RANK_LINE = b"x-data-parallel-rank:"


def names_client_rank(headers: bytes) -> bool:
    """Whether the request-header lines ``headers`` carry the client's own ``X-data-parallel-rank``."""
    return headers.startswith(_CLIENT_RANK_LINE) or b"\r\n" + _CLIENT_RANK_LINE in headers


def with_dp_rank(body: bytes, rank: int) -> bytes:
    """The JSON object ``body`` with ``"routed_dp_rank": rank`` added first (a client's own value, later, wins)."""
    return put_first(body, b"routed_dp_rank", b"%d" % rank)


def _has_tools(body: dict) -> bool:
    """Whether a chat body carries tool definitions, assistant tool calls or tool results."""
    if body.get("tools"):
        return True
    msgs = body.get("messages")
    return isinstance(msgs, list) and any(
        isinstance(m, dict) and (m.get("tool_calls") or m.get("role") == "tool") for m in msgs)


def decode_budget(body: dict) -> int:
    """Decode tokens a request counts in the load (see the module docstring)."""
    v = body.get("max_completion_tokens", body.get("max_tokens"))
    sp = body.get("sampling_params")
    if v is None and isinstance(sp, dict):
        v = sp.get("max_new_tokens")
    if type(v) is not int or v < 0:
        v = DEFAULT_DECODE_TOKENS
    return min(v, MAX_DECODE_TOKENS)


def _overflow(footprint: int, need: int, pool: int) -> int:
    """Tokens of a request's KV (``need``: its whole prompt + decode budget) that do not fit in a
    target's KV pool of ``pool`` tokens beside the ``footprint`` already held or promised there: the
    load term's tokens plus the union of the cached prefixes of this router's in-flight requests there
    (:meth:`.held.HeldPrefixes.pinned`: a system prompt that many share counts once).

    Cached prefixes count because a request keeps its prefix only while the pool holds it: a running
    request locks its pages, and a waiting one finds them at admission only if nothing evicted them
    meanwhile.  When the requests sent to a target need more than its pool, the engine's LRU evicts
    the prefixes of those still waiting (their own pages are the least recently used once every idle
    prefix is gone) and they prefill them again: on the simulated workers with 40k-token pools,
    2.4-3.6k-token turns and 10-13 running per worker, runs whose queues grew to 6-10 per worker
    lost 11-21% of the predicted cached tokens that way, against 1-6% in runs whose queues stayed
    short (docs/benchmarks.md ``routing-kv-rate-evicted-in-queue``, where this term, at weight 1,
    lowered that loss in 2 of 3 runs but did not keep the queues short in the third).  The request's
    own prompt counts whole: a part of it that running requests already hold is counted twice (errs
    high by at most its cached part).  Those tokens wait or are computed again, so
    ``--kv-overflow-weight`` (default 0, off) counts them like uncached prefill tokens.
    """
    return max(0, footprint + need - pool)


def _shared_queued(tokens: list[int], cached: int, queued_keys, text: str | None = None) -> int:
    """Tokens of the queued prefill (``queued_keys``' uncached parts) that fall inside the first ``cached``
    tokens of ``tokens``: the request is predicted to use those pages, not to compute them, so its
    queued-prefill term leaves them out (a burst of one new prefix then follows its first request).

    For each queued request ``k``, its uncached range ``[k.cached, k.prompt_tokens)`` overlaps
    ``[0, cached)`` as far as the two prompts agree (:func:`_agree_from`).  ``text``: the request's
    ids text with one character per id, if it has one; the prompts are then compared as those
    strings where ``k`` has one too (the same answer, faster).  Cost: O(queued requests x log
    prompt) slice comparisons.  The policy gets the same figure for every target at once from
    :meth:`~.pending.SortedPrompts.scan` where it can; this scan is the reference and the fallback.
    """
    shared = 0
    n = len(tokens)
    for k in queued_keys:
        ktoks = k.tokens
        if ktoks is None:
            continue
        lo, hi = k.cached, min(cached, len(ktoks), n)
        if hi <= lo:
            continue  # nothing of its queued part lies in the cached prefix
        kt = one_char_per_id(k) if text is not None else None
        if kt is not None:  # positions shift by one: the marker comes first in both
            if text[:lo + 1] != kt[:lo + 1]:
                continue  # they differ before its queued part begins
            shared += _agree_from(text, kt, lo + 1, hi + 1) - 1 - lo
        else:
            if ktoks[:lo] != tokens[:lo]:
                continue
            shared += _agree_from(tokens, ktoks, lo, hi) - lo
    return shared


def _pending_prefix(tokens: list[int], limit: int, queued_keys, text: str | None = None) -> int:
    """The longest prefix of ``tokens[:limit]`` that one of ``queued_keys`` (requests routed to a target
    whose prefill has not ended) starts with: the target computes it before or beside this request
    (the engines wait a step to share a prefix in prefill), so it counts as cached there although no
    KV event can have announced it yet.  ``text``: as for :func:`_shared_queued`.  Cost: O(queued
    requests x log prompt) slice comparisons (the policy's fast path: :meth:`~.pending.SortedPrompts.scan`).
    """
    n = min(limit, len(tokens))
    best = 0
    for k in queued_keys:
        ktoks = k.tokens
        if ktoks is None:
            continue
        hi = min(n, len(ktoks))
        if hi <= best:
            continue  # it cannot beat the best so far
        kt = one_char_per_id(k) if text is not None else None
        if kt is not None:  # positions shift by one: the marker comes first in both
            if text[best + 1] != kt[best + 1] or text[:best + 1] != kt[:best + 1]:
                continue  # it agrees on no more than the best so far
            best = _agree_from(text, kt, best + 2, hi + 1) - 1
        else:
            if ktoks[best] != tokens[best] or ktoks[:best] != tokens[:best]:
                continue  # (the token after the best differs: no slice copied)
            best = _agree_from(tokens, ktoks, best + 1, hi)
    return best


def _held_cached(held: HeldPrefixes, counts_from: float | None, waiting: bool = True) -> int:
    """Cached prompt tokens (``cached_tokens`` at their decision) of this router's in-flight requests on
    a target (``held``) that its engine snapshot counts (sent before ``counts_from``, :meth:`.loads.
    EngineLoads.counts_from`; None: no snapshot, 0).

    The engine's ``num_total_tokens`` counts a request's whole prompt (a waiting one its length, a
    running one the KV it holds, cached prefix included), the router's load only what the request
    adds (uncached prompt + decode budget).  Taken raw, ``max(router, engine)`` thus charges a target
    about its requests' cached prefixes in addition: the more of this router's requests hit there,
    the more loaded it looks, and under direct traffic (which keeps the engine's figure fresh and
    above the router's) conversations were pushed off their own cache (docs/router.md, the load
    term and the engines' loads).  Taking these tokens off puts the engine's figure in the
    router's units; what is left over the router's count is traffic it did not send.  Running
    requests that share a cached prefix hold it once, so their part is the union of their prefixes,
    waiting ones count each (:mod:`.held`).  ``waiting=False``: the engine's figure counts no waiting
    request (vLLM's, :attr:`.loads.EngineLoads.running_only`), so only the running union comes off.
    """
    return held.counted(counts_from, waiting)


def idle_rule(best_wait: float, idle_wait: float, abs_threshold: float, rel_threshold: float) -> bool:
    """Whether a request leaves the lowest-cost target, whose estimated wait to its first token is
    ``best_wait``, for an idle target (nothing of this router in flight there, no prefill queued)
    whose wait is ``idle_wait``; both in cost units (tokens of prefill at ``--kv-prefill-weight``)::

        wait(t) = --kv-prefill-weight x (prompt_tokens - cached_tokens(t) + queued_prefill(t))
                + --kv-load-weight x load_tokens(t)

        move  iff  rel > 0  and  best_wait - idle_wait > abs  and  best_wait > rel x idle_wait

    The form is sglang-router's cache_aware balance test (imbalanced when ``max - min >
    --balance-abs-threshold`` and ``max > --balance-rel-threshold x min``), applied to the estimated
    wait instead of in-flight request counts, and only towards an idle target: there the request's
    own uncached tokens delay nobody (the cost counts them also as work that delays the requests
    after it, which an idle core does not have), so only its wait matters.  The defaults
    (:data:`IDLE_ABS_THRESHOLD`, :data:`IDLE_REL_THRESHOLD`) are ours, from the states of
    docs/benchmarks.md ``routing-kv-engine-2`` (docs/router.md, the idle rule).
    """
    return rel_threshold > 0 and best_wait - idle_wait > abs_threshold and best_wait > rel_threshold * idle_wait


def balance_floor(values: list[float], band: float) -> float:
    """The part of each target's queued prefill (or token load) that its balance term ignores:
    ``(1 + band) x`` the lowest value among the targets (``values``, tokens; ``band`` >= 0, a share).

    With ``--kv-balance-band`` b > 0 the cost counts ``max(0, queued(t) - (1 + b) x min queued)`` in
    place of ``queued(t)``, and so for the load term.  Subtracting one figure from every target leaves
    the order of costs unchanged, so only the band changes decisions: targets whose queues lie within
    (1 + b) x the shortest pay no balance cost at all and are ranked on their cached tokens alone, as
    sglang-router's cache_aware routes on its tree until ``max > --balance-rel-threshold x min``
    (there on request counts).  Where the lowest target is idle the floor is 0 and the cost is the
    plain one: the band tolerates a difference only in proportion to the whole backlog, so it holds a
    request on its cache under a deep, evenly spread queue (where chance differences of a few thousand
    tokens would otherwise outweigh a whole hit) and leaves the first-turn spread and the pile-up
    guard as they were.  The form is ours (docs/router.md, the balance band).
    """
    return (1.0 + band) * min(values)


def queue_weight_under(queue_weight: float, backlog: float, unit: float, discount: float) -> float:
    """The queued-prefill term's weight (cost per queued token) when every target has at least
    ``backlog`` uncached prompt tokens queued (the least queued prefill over the targets: workers, or
    DP ranks with ``--dp-aware``; tokens); ``unit``: the mean uncached prompt tokens of a queued
    request (this router's queued requests, all targets; the request's own prompt tokens when it has
    none queued); ``discount`` is ``--kv-backlog-discount`` (> 0)::

        weight = queue_weight / (1 + discount x backlog / unit)

    Leaving a target that holds ``h`` of the prompt's tokens for one with a queue shorter by ``d``
    saves this request ``d - h`` of waiting and adds ``h`` tokens of prefill the fleet would not
    otherwise do; those delay every request queued behind it there until that queue next drains.
    With a target idle or nearly so (``backlog`` 0) that is soon, and the term weighs as set; when
    every target has a backlog, the fleet is at or over its capacity, no queue drains soon, and the
    added work is paid by the requests after this one, about ``backlog / unit`` of them on every
    target: a difference between deep queues then buys less than the hit costs.  The unit is the
    queued requests' size rather than this request's own prompt, since it counts the requests that
    pay: a 100-token prompt with 64 tokens cached is not held behind 33k more queued tokens to save
    64 (a user trial's state).  Measured: over capacity with 30% of the traffic sent straight to
    random workers, the full term moved 48-53 routed turns of 1200 requests off their cache, and
    TTFT p90 was 1.13-1.26x cache_aware's in 3 runs; with this discount 8-12 moves and 0.84-0.85x in
    2 (docs/benchmarks.md ``routing-kv-rate-backlog-notes``, ``-unit-notes``).  The form is ours.
    """
    if unit <= 0:
        return queue_weight
    return queue_weight / (1.0 + discount * backlog / unit)


class KvAwarePolicy:
    """See the module docstring.  ``select`` runs on the event loop; events arrive on threads."""

    name = "kv_aware"

    def __init__(self, prefill_weight: float = 1.0, load_weight: float = 0.1, speculative_ttl_s: float = 2.0,
                 max_blocks: int = 1 << 20, dp_aware: bool = False, tokenizer: RouterTokenizer | None = None,
                 tokenize_threads: int = 2, route_header: bool = True, overflow_weight: float = 0.0,
                 queue_weight: float = 0.5, balance_abs_threshold: float = IDLE_ABS_THRESHOLD,
                 balance_rel_threshold: float = IDLE_REL_THRESHOLD, balance_band: float = BALANCE_BAND,
                 backlog_discount: float = BACKLOG_DISCOUNT, router_queue_threshold: float | None = None) -> None:
        self.route_header = route_header
        self.backlog_discount = backlog_discount  # --kv-backlog-discount (0: off; queue_weight_under)
        self.balance_band = balance_band  # --kv-balance-band (0: off; balance_floor)
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold  # 0: the idle rule is off
        self.idle_moves = 0  # decisions the idle rule moved to an idle target (see idle_rule)
        self.overflow_weight = overflow_weight
        self.queue_weight = queue_weight
        self.prefill_weight = prefill_weight
        self.load_weight = load_weight
        self.speculative_ttl_s = speculative_ttl_s
        self.dp_aware = dp_aware
        self.index = BlockIndex(max_blocks)
        self.tree = RadixTree()
        self.last_claim = None  # the tree entry of the last decision (CacheAwarePolicy.last_claim)
        self.tokenizer = tokenizer
        self._pool = ThreadPoolExecutor(tokenize_threads, thread_name_prefix="kv-tokenize") if tokenizer else None
        self.subs: dict[str, dict[int, object]] = {}  # worker url -> rank -> Subscription (set by the sources)
        # worker url -> its DP ranks from /get_server_info's dp_size (set by the sources): the ranks of a worker
        # that publishes no KV events (with streams, the ranks are those of its streams)
        self.dp_ranks: dict[str, tuple[int, ...]] = {}
        self.load_tokens: dict = {}  # (url, rank or None) -> in-flight tokens
        self.queued_tokens: dict = {}  # (url, rank or None) -> uncached prompt tokens whose prefill has not ended
        self.queued_keys: dict = {}  # (url, rank or None) -> the RouteKeys counted in queued_tokens
        self.queued_requests = 0  # RouteKeys in queued_keys, all targets (the backlog discount's unit)
        self.queued_sum = 0  # their uncached prompt tokens, all targets
        self.sorted_prompts = SortedPrompts()  # the same keys' prompts, all targets in one sorted list
        self.inflight: dict = {}  # (url, rank or None) -> in-flight requests
        self.held: dict = {}  # (url, rank or None) -> HeldPrefixes: its in-flight requests with cached tokens
        self.decisions = {EXACT: 0, DEGRADED: 0, FALLBACK: 0}
        self._engine_loads = None
        self.inferred_prefills = 0  # non-streamed requests whose prefill end an engine snapshot told (engine_snapshot)
        self.too_long = 0  # prompts over MAX_TOKENIZE_CHARS, routed on their text (prepare)
        self.tokenizer_check = TokenizerCheck()
        self.chosen_at: dict = {}  # (url, rank or None) -> number of the decision that last chose it (ties)
        self._decisions = 0
        # --router-queue-threshold: requests wait in the router while every target is busy (router_queue.py)
        self.router_queue = RouterQueue(self, router_queue_threshold) if router_queue_threshold is not None else None

    @property
    def engine_loads(self):
        """The engines' ``/v1/loads`` figures (an :class:`~.loads.EngineLoads`) when
        ``--kv-loads-interval-secs`` > 0, else None; set here, it calls :meth:`engine_snapshot` on
        each new snapshot."""
        return self._engine_loads

    @engine_loads.setter
    def engine_loads(self, loads) -> None:
        self._engine_loads = loads
        if loads is not None:
            loads.on_snapshot = self.engine_snapshot

    def engine_snapshot(self, url: str) -> None:
        """A new ``/v1/loads`` snapshot of ``url`` arrived: end the queued prefill of this router's
        non-streamed requests there that the engine has admitted.

        A streamed request's prefill ends with its first answer bytes (:meth:`prefilled`); a
        non-streamed one shows nothing until its whole answer, so without this it would count as
        queued prefill (and, in the engine's units, as waiting) through all its decode steps and push
        later requests off a worker whose queue is empty.  The snapshot's ``num_waiting_reqs`` W
        (per DP rank; summed for a whole worker) bounds how many of them can still wait: of the
        non-streamed requests on the target sent at least :data:`KNOWN_AFTER_S` before the figures
        were taken (so surely counted by the engine), taken in the order sent, all but the last W
        have been admitted, as a first-come-first-served queue admits (SGLang's ``fcfs``, vLLM's
        and our scheduler; under SGLang's ``lpm`` the count is right, the choice of which may not
        be).  Those leave the queued prefill and count as running (:class:`.held.HeldPrefixes`); the
        engine's waiting figures did not count them, so nothing is taken off those
        (:meth:`_end_prefill`).  Engines that report no ``num_waiting_reqs`` (vLLM) change nothing.
        """
        if self.router_queue is not None:  # its figures changed: a waiting request may go
            self.router_queue.pump()
        loads = self._engine_loads
        per = loads.waiting_reqs.get(url) if loads is not None else None
        if not per:
            return
        cut = loads.counts_from(url)
        if cut is None:
            return
        cut -= KNOWN_AFTER_S
        for lk, keys in list(self.queued_keys.items()):
            if lk[0] != url:
                continue
            w = sum(per.values()) if lk[1] is None else per.get(lk[1])
            if w is None:
                continue
            known = [k for k in keys if not k.streamed and k.charged[2] < cut]
            for k in known[:len(known) - w] if w < len(known) else ():
                if self._end_prefill(k, engine_counted=False):
                    self.inferred_prefills += 1

    # ------------------------------------------------------------ per request
    async def prepare(self, path: str, body: dict, text: str, headers: dict | None = None) -> RouteKey:
        """Token ids of the request (inline when short, else on a worker thread: tokenize.py), as a RouteKey.
        ``headers``: the request's (lower-case names), for a DP rank the client named (:func:`client_dp_rank`)."""
        tokens = request_ids_without_tokenizer(path, body)
        tokenized = False
        chars = None  # the ids as characters, when the fast encoder joined them from its cached blocks
        if tokens is None and self.tokenizer is not None:
            try:
                if self.tokenizer.inline(path, body):  # short enough to cost less than a thread hand-off
                    tokens, chars = self.tokenizer.request_ids_chars(path, body)
                elif (text_size(path, body) or 0) > MAX_TOKENIZE_CHARS:  # not worth a core for seconds
                    self.too_long += 1
                    if self.too_long == 1 or self.too_long % 100 == 0:
                        log.warning("kv_aware: a prompt of %d characters, over the %d this router tokenizes, is "
                                    "routed on its text (branch=fallback reason=text; %d so far)",
                                    text_size(path, body), MAX_TOKENIZE_CHARS, self.too_long)
                else:
                    tokens = await asyncio.get_running_loop().run_in_executor(
                        self._pool, self.tokenizer.request_ids, path, body)
                tokenized = tokens is not None
            except Exception as e:  # a tokenizer failure must not fail the request: route on the text
                log.warning("kv_aware: tokenization failed (%s: %s); routing on the text", type(e).__name__, e)
                tokens = None
        key = RouteKey(text, tokens, decode_budget(body), chars)
        # a chat with tools: how tools reach the template is the engine's own (ours writes them into the
        # system prompt for templates without tools), so its count says nothing of the tokenizer; not
        # checked (a function-calling workload marked a worker with the right tokenizer as mismatched)
        key.tokenized = tokenized and not (path == "/v1/chat/completions" and _has_tools(body))
        key.streamed = body.get("stream") is True
        if self.dp_aware:
            key.client_rank = client_dp_rank(body, headers)
        if self.router_queue is not None:  # every target busy: wait here, and be routed when one frees up
            key.held = await self.router_queue.wait()
        return key

    def ranks(self, url: str) -> list[int] | tuple[int, ...]:
        """The worker's DP ranks: those of its KV-event streams, else ``range(dp_size)`` from its
        ``/get_server_info`` (:attr:`dp_ranks`), else those its vLLM ``/metrics`` names (``engine``
        labels, :attr:`.loads.EngineLoads.engine_ranks`), else rank 0 alone."""
        subs = self.subs.get(url)
        if subs:
            return sorted(subs)
        ranks = self.dp_ranks.get(url)
        if ranks is None and self._engine_loads is not None:
            ranks = self._engine_loads.engine_ranks.get(url)
        return ranks or _RANK_0

    def ranks_known(self, url: str) -> bool:
        """Whether :meth:`ranks` of ``url`` comes from the worker (its KV-event streams, its
        ``/get_server_info`` dp_size or its vLLM gauges) rather than the rank-0 default."""
        return (bool(self.subs.get(url)) or url in self.dp_ranks
                or (self._engine_loads is not None and url in self._engine_loads.engine_ranks))

    def trust(self, url: str, rank: int) -> str:
        """The trust the policy gives the target: the stream's, or ``fallback`` for a worker whose
        tokenizer differs from the router's (:mod:`.tokenizer_check`)."""
        if self.tokenizer_check.mismatched(url):
            return FALLBACK
        sub = self.subs.get(url, {}).get(rank)
        return sub.state if sub is not None else FALLBACK

    def answered(self, key, url: str, data: bytes | None) -> None:
        """A 200 answer from ``url`` (``data``: its body, or a stream's last chunks) to ``key``:
        its prompt count is compared with the router's when the router tokenized the prompt."""
        if isinstance(key, RouteKey) and key.tokenized and key.tokens:
            self.tokenizer_check.observe(url, len(key.tokens), data)

    def _choose(self, workers: list, key):
        """The worker with the lowest cost among ``workers``; the decision is written into ``key``."""
        if not workers:
            if key.held:
                self._routed(key)
            return None
        if key.charged is not None:
            self.release(key)  # a retry: the failed attempt's tokens are no longer in flight
        tokens = key.tokens
        per_tenant = self.tree.match_per_tenant(key.tree_text()) if (tokens or key.text) else {}
        ids1 = one_char_per_id(key)  # for _pending_prefix / _shared_queued
        subs = self.subs
        if self.dp_aware:  # one target per DP rank; only the rank the client named, when it named one
            pin = key.client_rank
            if pin is None:
                targets = [(w, r, (r,)) for w in workers for r in self.ranks(w.url)]
            else:  # a worker whose ranks are not known yet (no stream, no dp_size from /get_server_info so
                # far) may have it: the engine runs it there (or refuses it), so it is charged there
                targets = [(w, pin, (pin,)) for w in workers if pin in self.ranks(w.url) or not self.ranks_known(w.url)]
            if not targets:  # a rank no worker has: the engine refuses it (400); route as if none was named
                targets = [(w, r, (r,)) for w in workers for r in self.ranks(w.url)]
        else:  # one target per worker, the best of its ranks
            targets = [(w, None, None) for w in workers]
        # the engine always computes the last prompt token (vLLM, SGLang and ours match at most
        # prompt[:-1], in whole pages), so the prefix that can be cached is prompt[:-1].  Before any
        # target's first event the index holds nothing (no block size known): no match to look up.
        index = self.index
        if tokens and index.block_size:
            matched = index.match(tokens[:-1], [(w.url, r) for w in workers for r in self.ranks(w.url)])
        else:
            matched = _NONE
        prompt_tokens = key.prompt_tokens
        cap = prompt_tokens - 1 if prompt_tokens > 0 else 0
        engine_loads = self._engine_loads
        # the engines' figures (loads.py), read only where a worker has a snapshot at all
        snapshots = engine_loads.snapshots if engine_loads is not None else None
        now = time.monotonic() if snapshots else 0.0
        load_tokens, queued_tokens = self.load_tokens, self.queued_tokens
        prefill_weight, load_weight = self.prefill_weight, self.load_weight
        overflow_weight = prefill_weight * self.overflow_weight
        queue_weight = prefill_weight * self.queue_weight
        mismatched = self.tokenizer_check.bad  # the workers whose tokenizer differs (tokenizer_check.py)
        queued_keys_of = self.queued_keys if tokens else _NONE  # a text prompt shares no queued ids
        block_sizes = index.block_size  # empty until a first event: every page size is 1 then
        firsts = []  # each target's cached_tokens before its queued prompts are looked at, and what it needs then
        stop = None  # the least cached_tokens among the targets the sorted scan covers
        for w, rank, ranks in targets:
            url = w.url
            tenant = url if rank is None else f"{url}#{rank}"
            if tokens:  # the tree holds the ids text, whose first character is a marker (routing_text.ids_text)
                tree_tokens = per_tenant.get(tenant, 0) - 1
                if tree_tokens < 0:
                    tree_tokens = 0
                reason = TOKENIZER if mismatched and url in mismatched else None
            else:  # the prompt's text, at CHARS_PER_TOKEN characters a token
                tree_tokens = int(per_tenant.get(tenant, 0) * _PER_CHAR)
                reason = TEXT
            wsubs = subs.get(url) if subs else None
            if reason is not None or not wsubs:  # no usable KV-event stream: the approximate tree
                cached, branch = tree_tokens, FALLBACK
            else:
                cached, branch = -1, FALLBACK
                for r in (ranks or sorted(wsubs)):
                    sub = wsubs.get(r)
                    state = sub.state if sub is not None else FALLBACK
                    if state == FALLBACK:
                        c = tree_tokens
                    else:
                        ev = matched.get((url, r), 0)
                        c = ev if state == EXACT else max(ev, tree_tokens)
                    if c > cached:
                        cached, branch = c, state
            if cached > cap:
                cached = cap
            lk = (url, rank)
            pending_keys = queued_keys_of.get(lk)  # its QueuedKeys (never empty), None when it has none
            covered = pending_keys is not None and ids1 is not None and not pending_keys.odd  # by the sorted scan
            if covered and (stop is None or cached < stop):
                stop = cached
            firsts.append((w, rank, url, tenant, reason, branch, cached, lk, pending_keys, covered))
        # every covered target's queued prompts at once (pending.py); a target with an odd key scans its own.
        # The scan walks only the prompts that share more than `stop` ids (at most the least cached_tokens
        # of those targets and the least `cached` of the queued keys): the others overlap no queued part,
        # and the longest prefix a target shares with them is at most its cached_tokens, which it then keeps
        scanned = None
        if stop is not None:
            sorted_prompts = self.sorted_prompts
            if sorted_prompts.texts:
                lowest = sorted_prompts.cached[0]
                scanned = sorted_prompts.scan(ids1, stop if stop < lowest else lowest)
        rows = []  # each target's cost inputs; scored once all are known (the band needs their lowest)
        q_min = l_min = math.inf  # the least queued prefill and load over the targets (the band's floors)
        inflight = self.inflight
        for order, (w, rank, url, tenant, reason, branch, cached, lk, pending_keys, covered) in enumerate(firsts):
            # (longest shared prefix, pairs) from the one sorted scan, when it covers this target
            agreed = scanned.get(lk, _NOTHING_SHARED) if covered and scanned is not None else None
            if pending_keys is not None and cached < cap:  # a prefix still in prefill there: no event yet, but it will be held
                if agreed is not None:
                    pending = agreed[0]
                    if pending > cap:
                        pending = cap
                else:
                    pending = _pending_prefix(tokens, cap, pending_keys, ids1)
                bs = self._block_size(url, rank) if block_sizes else 1
                if bs > 1:
                    pending -= pending % bs  # the engine shares whole pages only
                if pending > cached:
                    cached = pending
            load = mine = load_tokens.get(lk, 0)
            seen = None
            queued = queued_tokens.get(lk, 0) if queue_weight else 0
            if snapshots and url in snapshots:  # the engine's own figures, while fresh (loads.py)
                seen, waiting = engine_loads.figures(url, rank, now)
                if seen is not None and seen > load:
                    held = self.held.get(lk)
                    if held is not None:  # in the router's units: without the cached prefixes of its requests it counts
                        seen = max(0, seen - _held_cached(held, engine_loads.counts_from(url),
                                                          url not in engine_loads.running_only))
                    if seen > load:
                        load = seen
                if queue_weight and waiting is not None and waiting > queued:  # its prefill work ahead
                    queued = waiting
            if queued and cached and tokens:  # the part of it this request shares is in its cached_tokens
                if agreed is not None:  # each queued key's overlap of [its cached, this request's cached)
                    shared = 0
                    for a, lo in agreed[1]:
                        shared += (a if a < cached else cached) - lo if lo < cached else 0
                else:
                    shared = _shared_queued(tokens, cached, queued_keys_of.get(lk, ()), ids1)
                queued = queued - shared if queued > shared else 0
            uncached = prompt_tokens - cached
            extra = 0.0
            if overflow_weight and engine_loads is not None:  # KV that does not fit waits: see _overflow
                pool = engine_loads.capacity(url, rank)
                if pool is not None:  # the pool must also keep the cached prefixes in-flight requests use
                    held = self.held.get(lk)
                    pinned = held.pinned() if held else 0
                    extra = overflow_weight * _overflow(load + pinned, prompt_tokens + key.decode_tokens, pool)
            reqs = inflight.get(lk, 0) if rank is not None else w.load
            if queued < q_min:
                q_min = queued
            if load < l_min:
                l_min = load
            rows.append((uncached, queued, load, extra, reqs, lk, order, w, rank, branch, cached, reason, tenant,
                         mine, seen))
        terms = [] if log.isEnabledFor(logging.DEBUG) else None  # each target's cost terms, for the debug log
        idle_on = self.balance_rel_threshold > 0 and len(rows) > 1
        idle_best = None  # (wait, order, w, rank, branch, cached, reason) of the idle target that waits least
        best = None
        best_wait = 0.0
        chosen_at = self.chosen_at
        band = self.balance_band
        q_floor = l_floor = 0.0
        if band and len(rows) > 1:  # the balance terms count only the excess over the band (balance_floor)
            q_floor = (1.0 + band) * q_min
            l_floor = (1.0 + band) * l_min
        floors = q_floor or l_floor
        unit = None  # the backlog discount's unit, when it applies: the size of this router's queued requests
        if self.backlog_discount and queue_weight and q_min > 0 and len(rows) > 1:
            n = self.queued_requests
            unit = self.queued_sum / n if n else prompt_tokens
            queue_weight = queue_weight_under(queue_weight, q_min, unit, self.backlog_discount)
        best_cost = best_tie = None
        for uncached, queued, load, extra, reqs, lk, order, w, rank, branch, cached, reason, tenant, mine, seen in rows:
            if floors:
                over_q, over_l = queued - q_floor, load - l_floor
                cost = (prefill_weight * uncached + queue_weight * (over_q if over_q > 0.0 else 0.0)
                        + load_weight * (over_l if over_l > 0.0 else 0.0) + extra)
            else:  # the same figure: queued and load are never negative
                cost = prefill_weight * uncached + queue_weight * queued + load_weight * load + extra
            if terms is not None:
                terms.append(f"{tenant} {branch} cached={cached} queued={queued} load={load} (router {mine}, "
                             f"engine {'-' if seen is None else seen}) reqs={reqs}"
                             f"{f' overflow={extra:.1f}' if extra else ''} cost={cost:.1f}")
            if idle_on:
                wait = prefill_weight * (uncached + queued) + load_weight * load
                if not reqs and not queued and (idle_best is None or wait < idle_best[0]):
                    idle_best = (wait, order, w, rank, branch, cached, reason)
            # lowest cost; ties: fewest in-flight requests, then the least recently chosen, then the order
            if best_cost is None or cost < best_cost or (
                    cost == best_cost and (reqs, chosen_at.get(lk, -1), order) < best_tie):
                best_cost, best_tie = cost, (reqs, chosen_at.get(lk, -1), order)
                best = (w, rank, branch, cached, reason)
                if idle_on:
                    best_wait = wait
        if terms is not None and (q_floor or l_floor):
            terms.append(f"band {band}: queued counted above {q_floor:.0f}, load above {l_floor:.0f}")
        if terms is not None and unit is not None:
            terms.append(f"backlog {q_min:.0f} on every target, unit {unit:.0f}: queue weight {queue_weight:.3f} "
                         "(counted above the band's floor)")
        w, rank, branch, cached, reason = best
        if (idle_best is not None and idle_best[1] != best_tie[2]
                and idle_rule(best_wait, idle_best[0], self.balance_abs_threshold, self.balance_rel_threshold)):
            if terms is not None:
                terms.append(f"idle rule: wait {best_wait:.1f} on {w.url} against {idle_best[0]:.1f} on the idle "
                             f"{idle_best[2].url}: moved")
            self.idle_moves += 1
            _, _, w, rank, branch, cached, reason = idle_best
        if terms is not None:
            log.debug("kv_aware cost: prompt=%d decode=%d | %s", prompt_tokens, key.decode_tokens, " | ".join(terms))
        key.target, key.rank, key.branch, key.cached = (w.url, rank), rank, branch, cached
        key.reason = reason
        self._record(w.url, rank, key)
        if key.held:
            self._routed(key)
        return w

    def _routed(self, key) -> None:
        """``key``, let go by the router queue, was routed (or will not be): the next one may go."""
        key.held = False
        self.router_queue.routed()

    def load_term(self, url: str, rank: int | None, now: float | None = None) -> int:
        """The ``load_tokens(t)`` the cost uses for the target now: this router's in-flight tokens there,
        or while the engine's ``/v1/loads`` figure is fresh and higher, that figure less the cached
        prefixes of this router's requests it counts (:func:`_held_cached`), whichever is larger.
        The same figure as in ``_choose`` (for ``/metrics``; the hot path keeps its own copy)."""
        lk = (url, rank)
        load = self.load_tokens.get(lk, 0)
        engine_loads = self._engine_loads
        if engine_loads is not None:
            seen = engine_loads.figures(url, rank, time.monotonic() if now is None else now)[0]
            if seen is not None and seen > load:
                held = self.held.get(lk)
                if held is not None:
                    seen = max(0, seen - _held_cached(held, engine_loads.counts_from(url),
                                                      url not in engine_loads.running_only))
                if seen > load:
                    load = seen
        return load

    def _block_size(self, url: str, rank: int | None) -> int:
        """The target's page size from its events (a whole worker: its ranks' largest); 1 when unknown."""
        sizes = self.index.block_size
        if not sizes:  # no event yet from any target
            return 1
        if rank is not None:
            return sizes.get((url, rank), 1)
        return max((sizes.get((url, r), 1) for r in self.ranks(url)), default=1)

    def select(self, workers: list, key, retry: bool = False):
        """The worker with the lowest cost; the decision is written into ``key``."""
        if not isinstance(key, RouteKey):
            key = RouteKey(key or "")
        if self.router_queue is not None and not retry:  # the targets its busy test looks at
            self.router_queue.workers = workers
        w = self._choose(workers, key)
        if w is not None:
            self.decisions[key.branch] += 1
        return w

    def pin(self, worker, key) -> None:
        """``--sticky-sessions`` chose ``worker``: decide the rest as :meth:`select` would on it alone.

        With ``--dp-aware`` its lowest-cost DP rank is chosen; the request is counted in the load,
        the tree and the speculative entries like any other, and ``key.branch`` becomes
        :data:`SESSION` (the route header's ``branch=session``).  ``key.cached`` is the prediction
        for ``worker``.  Not counted in ``decisions`` (the policy did not pick the worker).
        """
        if not isinstance(key, RouteKey):
            return
        self._choose([worker], key)
        key.branch, key.reason = SESSION, None

    def decorate(self, key, body: bytes, headers: bytes):
        """``(body, request header lines, response headers)`` for the attempt ``key`` was routed to.

        With ``--dp-aware`` the chosen rank goes in the body (``routed_dp_rank``, SGLang) and in
        the ``X-data-parallel-rank`` header (vLLM); ``x-fleetserve-route`` is added to the
        answer unless ``--no-route-header``.

        A rank the client named itself wins: its own ``routed_dp_rank`` (or ``data_parallel_rank``)
        comes later in the body than the router's and so wins there, and since the engine reads the
        header before the body (SGLang's order), the router adds no header when the client named a
        rank in the body or sent its own ``X-data-parallel-rank`` (passed on by proxy.py); the worker
        then gets at most one header, the client's.  (A prompt that merely contains the text
        ``"routed_dp_rank"`` also drops the router's header: its rank still goes first in the body.)
        """
        if not isinstance(key, RouteKey) or key.target is None:
            return body, headers, ()
        if key.rank is not None:
            named = b'"routed_dp_rank"' in body or b'"data_parallel_rank"' in body
            body = with_dp_rank(body, key.rank)
            if not named and not names_client_rank(headers):
                headers = headers + b"X-data-parallel-rank: %d\r\n" % key.rank
        if log.isEnabledFor(logging.DEBUG):
            log.debug("route: %s", key.route_header())
        return body, headers, (((HEADER, key.route_header()),) if self.route_header else ())

    def _record(self, url: str, rank: int | None, key: RouteKey) -> None:
        tenant = url if rank is None else f"{url}#{rank}"
        text = key.tree_text()
        if text:  # the entry the proxy takes back if the worker refuses the request (CacheAwarePolicy.last_claim)
            self.last_claim = (text, tenant, self.tree.insert(text, tenant))
        index = self.index
        if key.tokens and self.speculative_ttl_s > 0 and index.block_size:  # none before a first event
            for r in ((rank,) if rank is not None else self.ranks(url)):
                index.add_speculative((url, r), key.tokens, self.speculative_ttl_s)
        lk = (url, rank)
        self._decisions += 1
        self.chosen_at[lk] = self._decisions
        n = key.prompt_tokens - key.cached + key.decode_tokens  # the KV it adds there: shared pages count once
        self.load_tokens[lk] = self.load_tokens.get(lk, 0) + n
        self.inflight[lk] = self.inflight.get(lk, 0) + 1
        key.charged = (lk, n, time.monotonic())
        q = key.prompt_tokens - key.cached  # its own prefill: queued ahead of the next request until it ends
        key.queued = q
        if key.cached:  # in the order sent (a retry is re-added last)
            held = self.held.get(lk)
            if held is None:
                held = self.held[lk] = HeldPrefixes(self._block_size(url, rank))
            held.add(key)
        if q > 0:
            self.queued_tokens[lk] = self.queued_tokens.get(lk, 0) + q
            self.queued_requests += 1
            self.queued_sum += q
            keys = self.queued_keys.get(lk)
            if keys is None:
                keys = self.queued_keys[lk] = QueuedKeys()
            keys.append(key)
            self.sorted_prompts.add(key, lk)

    def prefilled(self, key) -> None:
        """The request's prefill ended (a stream's first answer bytes arrived): its uncached prompt tokens
        are no longer queued prefill on its target, and its speculative entries there last
        ``--kv-speculative-ttl-secs`` from now (its KV events are due).  Called again (or after
        :meth:`release`) it does nothing."""
        if self._end_prefill(key):
            lk = key.charged[0]
            index = self.index
            if key.tokens and self.speculative_ttl_s > 0 and index.block_size:
                url, rank = lk
                for r in ((rank,) if rank is not None else self.ranks(url)):
                    index.add_speculative((url, r), key.tokens, self.speculative_ttl_s)

    def _end_prefill(self, key, engine_counted: bool = True) -> bool:
        """Take the request out of its target's queued prefill; False if it was not (or no longer) in it.

        ``engine_counted=False``: the engine's current snapshot did not count it as waiting (its end was
        inferred from that snapshot, :meth:`engine_snapshot`), so nothing is taken off its figures."""
        if not isinstance(key, RouteKey) or not key.queued or key.charged is None:
            return False
        lk, _, sent = key.charged
        q, key.queued = key.queued, 0
        self.queued_requests -= 1
        self.queued_sum -= q
        left = self.queued_tokens.get(lk, 0) - q
        if left > 0:
            self.queued_tokens[lk] = left
        else:
            self.queued_tokens.pop(lk, None)
        keys = self.queued_keys.get(lk)
        if keys is not None:
            keys.remove(key)
            if not keys:
                del self.queued_keys[lk]
        self.sorted_prompts.remove(key)
        if key.cached:
            held = self.held.get(lk)
            if held is not None:
                held.prefilled(key)
        if engine_counted and self._engine_loads is not None:  # a snapshot that counted it as waiting must not count it still
            self._engine_loads.prefilled(lk[0], lk[1], sent, q)
        if self.router_queue is not None:  # a target's queued prefill went down: a waiting request may go
            self.router_queue.pump()
        return True

    def migrating(self, key, generated: int) -> None:
        """A stream of ``key`` failed mid-answer and goes on elsewhere (:mod:`..migration`): its target
        no longer holds it, so its load and queued prefill there come off now (:meth:`release`), and the
        continuation it becomes is ``generated`` tokens longer (the answer so far, appended to the
        prompt) and ``generated`` tokens shorter to decode.  The next :meth:`select` then charges the
        new target that whole prefill (less its predicted ``cached_tokens``) as queued until the
        continuation's first answer bytes (:meth:`prefilled`).  ``generated``: tokens produced since
        the last call (0: nothing to add)."""
        if not isinstance(key, RouteKey):
            return
        self.release(key)
        if generated > 0:
            key.prompt_tokens += generated
            key.decode_tokens = max(0, key.decode_tokens - generated)

    def release(self, key) -> None:
        """The request's answer ended (or its attempt failed): take its tokens out of the load."""
        if not isinstance(key, RouteKey):
            return
        if key.held:  # let go by the router queue but never routed (it failed before): the next one may go
            self._routed(key)
        if key.charged is None:
            return
        self._end_prefill(key)  # a non-streamed answer (or a failed attempt): its prefill is over too
        lk, n, sent = key.charged
        key.charged = None
        engine_loads = self._engine_loads
        shared = 0  # its cached tokens other running requests there still hold: the engine frees them not
        held = self.held.get(lk) if key.cached else None
        snapshot = engine_loads is not None and lk[0] in engine_loads.snapshots  # else nothing counts it
        if held is not None:  # what the engine frees of its cached prefix, when a snapshot counts it
            counted = snapshot and engine_loads.counts(lk[0], sent)
            freed = held.remove(key, counted)
            if counted and freed < key.cached:
                shared = key.cached - freed
            if not held:
                del self.held[lk]
        if snapshot:  # a snapshot that still counts it must not count it twice
            engine_loads.ended(lk[0], lk[1], sent, key.prompt_tokens - shared)
        left = self.load_tokens.get(lk, 0) - n
        if left > 0:
            self.load_tokens[lk] = left
        else:
            self.load_tokens.pop(lk, None)
        reqs = self.inflight.get(lk, 0) - 1
        if reqs > 0:
            self.inflight[lk] = reqs
        else:
            self.inflight.pop(lk, None)

    # ------------------------------------------------------------ workers
    def forget_cached(self, url: str, rank: int) -> None:
        """The worker's KV-event connection of DP rank ``rank`` was lost (:meth:`.subscriber.Subscription.lost`,
        which dropped its index entries): its entries in the approximate tree go too, the rank's and the
        whole worker's, so neither predicts what an engine that exited no longer holds.  Event loop only."""
        for tenant in (f"{url}#{rank}", url):
            if tenant in self.tree.tenant_sizes():
                self.tree.remove_tenant(tenant)

    def on_cache_flushed(self, url: str) -> None:
        """``url`` answered ``POST /flush_cache``: its index entries and its approximate-tree entries go at
        once (its ``AllBlocksCleared`` event follows, but a request sent before it arrived was predicted
        the old hits: a user trial saw ``cached_tokens=377`` right after a flush, 0 reported)."""
        prefix = url + "#"
        for tenant in [t for t in self.tree.tenant_sizes() if t == url or t.startswith(prefix)]:
            self.tree.remove_tenant(tenant)
        self.index.drop_cached(url)

    def on_worker_removed(self, url: str) -> None:
        if self._engine_loads is not None:  # its figures go at once, not at the next poll
            self._engine_loads.forget(url)
        prefix = url + "#"
        for tenant in [t for t in self.tree.tenant_sizes() if t == url or t.startswith(prefix)]:
            self.tree.remove_tenant(tenant)
        self.index.drop_worker(url)
        self.tokenizer_check.forget(url)
        for lk in [lk for lk in self.chosen_at if lk[0] == url]:
            del self.chosen_at[lk]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
