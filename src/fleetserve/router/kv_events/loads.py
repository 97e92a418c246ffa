"""The engines' own token loads (``GET /v1/loads``), to correct ``kv_aware``'s router-side counts.

Every ``--kv-loads-interval-secs`` (default 1 s; 0 turns this off) each worker is
asked ``GET /v1/loads?include=core`` (SGLang's endpoint, ours too; see
docs/load-and-metrics.md).  Of each ``loads[]`` entry the router keeps
``num_total_tokens`` (KV slots held by running requests + the waiting requests'
lengths + the chunked request's rest) per ``dp_rank``.

A snapshot is used only while it is the answer to the latest poll and at most
:data:`STALE_INTERVALS` intervals old.  Its age counts from when the engine took the
figures: each entry's ``timestamp`` (SGLang's field, ``time.time()`` in the scheduler; ours
too) when the answer has one (the oldest entry's), else from when the answer arrived.  An
engine that serves a cached figure (SGLang's DP controller keeps the ranks' last loads) is so
seen as old as it is.  The clocks of router and engine are taken to agree (NTP); a timestamp
ahead of the router's clock counts as taken on arrival.  Then a target's load in :mod:`.policy` is::

    load_tokens(t) = max(router-side in-flight tokens(t), engine num_total_tokens(t) - ended(t))

The engine's figure covers traffic this router never saw (other router
replicas, direct clients); the router's covers what it sent since the
snapshot.  Either one alone undercounts, so the larger one is used (summed
over ranks for a whole worker; one rank's for a ``--dp-aware`` target).
``ended(t)``: the prompt tokens of this router's requests that were in flight
on ``t`` when the figures were taken (when the poll was sent, for an answer without
``timestamp``) and whose answers ended after the snapshot arrived.  The snapshot still counts them (a running request holds its prompt's
KV, cached prefix included; a waiting one counts its length) and the router
knows they are gone, so they must not keep pushing traffic away until the
next poll (:meth:`EngineLoads.ended`).  Their generated tokens are not taken
off (how many the engine had made is unknown), so the figure errs high; it
errs low only where several of those requests shared a prefix on ``t`` (the
engine counts shared pages once), and never below 0.

A poll that fails drops the worker's snapshot at once: a figure that could not
be refreshed says nothing about now, and kept, it would still count requests
that ended long ago and push traffic away from an idle worker.  A
timeout or a connection error is asked again at the next interval: the worker
has the endpoint and is only slow (a CPU engine answers between two steps).
A worker that answers ``/v1/loads`` with anything but 200 JSON figures (vLLM; an older
engine) is asked ``GET /metrics`` instead, in the same poll: where that has vLLM's scheduler
gauges (:func:`vllm_figures`), the worker is polled there from then on.  A worker that has
neither is asked again only every :data:`RETRY_MISSING_S`.

vLLM's figures differ from SGLang's in what they count: ``vllm:kv_cache_usage_perc`` is the
share of the KV blocks that running requests reference (vLLM's ``BlockPool.get_usage``, which
leaves cached blocks no request uses out, as SGLang's ``num_used_tokens`` leaves evictable
slots out), and no figure counts the waiting requests' prompts.  So a vLLM snapshot's tokens
are the running requests' KV alone (:attr:`EngineLoads.running_only`), the cached prefixes
the policy takes off it are the running requests' only (:meth:`.held.HeldPrefixes.counted`),
it has no waiting tokens, and its ``num_waiting_reqs`` is ``vllm:num_requests_waiting`` (vLLM's
default scheduling is first come first served, which :meth:`.policy.KvAwarePolicy.
engine_snapshot` assumes).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

from prometheus_client.parser import text_string_to_metric_families

from .sources import MAX_DP_SIZE

log = logging.getLogger("fleetserve.router")

STALE_INTERVALS = 3  # a snapshot older than this many intervals is not used
RETRY_MISSING_S = 10.0
METRICS_MAX_BYTES = 8 << 20  # a /metrics page larger than this is not read for vLLM's gauges
MAX_GAUGE_LINES = 5 * MAX_DP_SIZE  # more lines of those gauges than this (4 per DP rank, and slack): not read
# the gauges of vLLM's /metrics that vllm_figures reads (all other lines are skipped unparsed: the page has
# hundreds of histogram lines); the deprecated gpu_cache_usage_perc is vLLM's name before 0.9
_VLLM_GAUGES = ("vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
                "vllm:cache_config_info")


def _gauge_lines(text: str, names) -> list[str]:
    """The sample lines of ``text`` (Prometheus text format) whose metric name is one of ``names``."""
    text = "\n" + text
    out = []
    for name in names:
        key = "\n" + name
        n = len(key)
        i = text.find(key)
        while i >= 0:
            end = text.find("\n", i + n)
            if end < 0:
                end = len(text)
            if end > i + n and text[i + n] in "{ \t":  # not a longer name that starts alike
                out.append(text[i + 1:end].rstrip())
            i = text.find(key, end)
    return out


def taken_at(doc) -> float | None:
    """The oldest entry ``timestamp`` (seconds since the epoch) of a ``/v1/loads`` answer; None without one."""
    loads = doc.get("loads") if isinstance(doc, dict) else None
    stamps = [e.get("timestamp") for e in loads if isinstance(e, dict)] if isinstance(loads, list) else []
    stamps = [t for t in stamps if type(t) in (int, float) and math.isfinite(t) and t > 0]
    return min(stamps) if stamps else None


def ranks_tokens(doc) -> dict[int, int] | None:
    """``{dp_rank: num_total_tokens}`` of a ``/v1/loads`` answer; None when it has no such figures."""
    loads = doc.get("loads") if isinstance(doc, dict) else None
    if not isinstance(loads, list):
        return None
    out = {}
    for e in loads:
        if not isinstance(e, dict):
            continue
        r, t = e.get("dp_rank", 0), e.get("num_total_tokens")
        if type(r) is int and type(t) is int and t >= 0:
            out[r] = t
    return out or None


def ranks_waiting(doc) -> dict[int, int] | None:
    """``{dp_rank: num_waiting_uncached_tokens}`` (prefill work still ahead) of a ``/v1/loads`` answer;
    None when it has no such figures (SGLang releases without the field, vLLM)."""
    loads = doc.get("loads") if isinstance(doc, dict) else None
    out = {}
    for e in loads if isinstance(loads, list) else ():
        if isinstance(e, dict):
            r, t = e.get("dp_rank", 0), e.get("num_waiting_uncached_tokens")
            if type(r) is int and type(t) is int and t >= 0:
                out[r] = t
    return out or None


def ranks_waiting_reqs(doc) -> dict[int, int] | None:
    """``{dp_rank: num_waiting_reqs}`` (requests queued, not admitted yet) of a ``/v1/loads`` answer;
    None when it has no such figures."""
    loads = doc.get("loads") if isinstance(doc, dict) else None
    out = {}
    for e in loads if isinstance(loads, list) else ():
        if isinstance(e, dict):
            r, n = e.get("dp_rank", 0), e.get("num_waiting_reqs")
            if type(r) is int and type(n) is int and n >= 0:
                out[r] = n
    return out or None


def ranks_capacity(doc) -> dict[int, int]:
    """``{dp_rank: max_total_num_tokens}`` (the KV pool's size in tokens) of a ``/v1/loads`` answer."""
    loads = doc.get("loads") if isinstance(doc, dict) else None
    out = {}
    for e in loads if isinstance(loads, list) else ():
        if isinstance(e, dict):
            r, c = e.get("dp_rank", 0), e.get("max_total_num_tokens")
            if type(r) is int and type(c) is int and c > 0:
                out[r] = c
    return out


def vllm_figures(text: str) -> tuple[dict[int, int], dict[int, int], dict[int, int]] | None:
    """``({dp_rank: KV tokens running requests hold}, {dp_rank: requests waiting}, {dp_rank: KV pool
    tokens})`` from vLLM's Prometheus ``/metrics`` text; None when it has no usable figures.

    Read, per ``engine`` label (the DP rank; none: rank 0), from the gauges vLLM v1's
    ``PrometheusStatLogger`` exports (vllm/v1/metrics/loggers.py): ``vllm:kv_cache_usage_perc``
    (else the older ``vllm:gpu_cache_usage_perc``; a share in [0, 1]), ``vllm:num_requests_waiting``,
    and the ``block_size`` and ``num_gpu_blocks`` labels of ``vllm:cache_config_info``.  vLLM's usage
    is ``1 - free_blocks / (num_gpu_blocks - 1)`` (``BlockPool.get_usage``; one block is its null
    block), so the tokens are ``round(usage * (num_gpu_blocks - 1) * block_size)`` and the pool
    ``(num_gpu_blocks - 1) * block_size``.  A rank without ``cache_config_info`` has no token figure.
    Values that are not finite, negative, or not numbers are skipped; several samples of one rank
    (more than one ``model_name``) count the largest.  A page with more than :data:`MAX_GAUGE_LINES`
    lines of these gauges is not parsed (None): no vLLM server has that many ranks.
    """
    lines = _gauge_lines(text, _VLLM_GAUGES)
    if not lines or len(lines) > MAX_GAUGE_LINES:
        return None
    usage: dict[int, float] = {}
    old_usage: dict[int, float] = {}
    waiting: dict[int, int] = {}
    pools: dict[int, int] = {}
    try:
        families = list(text_string_to_metric_families("\n".join(lines) + "\n"))
    except Exception:  # a line the parser refuses: no figures from this answer
        return None
    for fam in families:
        for s in fam.samples:
            try:
                rank = int(s.labels.get("engine", "0"))
            except ValueError:
                continue
            v = s.value
            if rank < 0 or not math.isfinite(v) or v < 0:
                continue
            name = s.name
            if name == "vllm:cache_config_info":
                try:
                    blocks, size = int(s.labels["num_gpu_blocks"]), int(s.labels["block_size"])
                except (KeyError, ValueError):  # not known yet ("None"), or absent
                    continue
                if blocks > 1 and size > 0:
                    pools[rank] = (blocks - 1) * size
            elif name == "vllm:num_requests_waiting":
                waiting[rank] = max(waiting.get(rank, 0), int(v))
            elif v <= 1.0:
                into = usage if name == "vllm:kv_cache_usage_perc" else old_usage
                into[rank] = max(into.get(rank, 0.0), v)
    for rank, v in old_usage.items():
        usage.setdefault(rank, v)
    tokens = {r: round(u * pools[r]) for r, u in usage.items() if r in pools}
    if not tokens:
        return None
    return tokens, {r: n for r, n in waiting.items() if r in tokens}, {r: pools[r] for r in tokens}


async def _read_capped(stream, cap: int) -> bytes | None:
    """The whole body of an aiohttp ``stream``, or None once it is over ``cap`` bytes (the rest unread)."""
    chunks, size = [], 0
    async for chunk in stream.iter_chunked(1 << 16):
        size += len(chunk)
        if size > cap:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


class EngineLoads:
    """Worker url -> snapshot ``(arrived, {dp_rank: tokens}, asked, taken)`` (monotonic seconds; ``taken``:
    when the engine took the figures, from its ``timestamp``, else ``arrived``); polled by :meth:`run`."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.snapshots: dict[str, tuple[float, dict[int, int], float, float]] = {}
        self._ended: dict[str, dict[int | None, int]] = {}  # url -> rank or None -> tokens ended since the snapshot
        self._missing: dict[str, float] = {}  # url -> when it last answered without figures
        self.waiting: dict[str, dict[int, int]] = {}  # url -> {dp_rank: uncached prompt tokens waiting}
        self._prefilled: dict[str, dict[int | None, int]] = {}  # url -> rank -> waiting tokens prefilled since
        self.pools: dict[str, dict[int, int]] = {}  # url -> {dp_rank: KV pool size in tokens}
        self.waiting_reqs: dict[str, dict[int, int]] = {}  # url -> {dp_rank: requests waiting} of the snapshot
        # the workers polled at GET /metrics (vLLM's gauges, vllm_figures) because they have no /v1/loads;
        # their snapshots count the running requests' KV only (no waiting requests' prompts)
        self.running_only: set[str] = set()
        # called with the url after every new snapshot (the policy infers which of its non-streamed
        # requests have left the engine's queue: policy.KvAwarePolicy.engine_snapshot)
        self.on_snapshot = None
        # url -> rank or None -> figures() of the current snapshot while fresh; dropped with every change of
        # the url's snapshot or of what this router saw end or prefill since (the policy asks per request)
        self._figures: dict[str, dict[int | None, tuple[int | None, int | None]]] = {}
        self._via_metrics: set[str] = set()  # the workers asked GET /metrics, not /v1/loads (vLLM)
        # url -> the DP ranks its vLLM /metrics names (engine labels 0..n-1): a vLLM server reports no dp_size
        # anywhere else (the policy's ranks for --dp-aware, the sources' ranks of a --kv-events-endpoint)
        self.engine_ranks: dict[str, tuple[int, ...]] = {}
        self._oversize: set[str] = set()  # the workers whose /metrics was too large to read (warned once)
        self._unread: set[str] = set()  # the workers without any figures (said once, until they have some)
        self._asking: set[str] = set()  # the workers whose poll is out
        self._tasks: set = set()  # the polls under way (kept referenced until done)
        self.polls = 0
        self.failures = 0

    def tokens(self, url: str, rank: int | None, now: float | None = None) -> int | None:
        """The engine's tokens on a target (``rank`` None: all ranks) less :meth:`ended`; None: stale / unknown."""
        snap = self.snapshots.get(url)
        return self._fresh_less(snap, snap and snap[1], self._ended.get(url), rank, now)

    def queued(self, url: str, rank: int | None, now: float | None = None) -> int | None:
        """The engine's prefill work still ahead on a target (``num_waiting_uncached_tokens``; ``rank``
        None: all ranks) less :meth:`prefilled`; None: stale, unknown, or not reported."""
        return self._fresh_less(self.snapshots.get(url), self.waiting.get(url), self._prefilled.get(url), rank, now)

    def figures(self, url: str, rank: int | None, now: float | None = None) -> tuple[int | None, int | None]:
        """``(tokens(url, rank), queued(url, rank))`` with one snapshot lookup (the policy asks both per target);
        computed once per snapshot and change of :meth:`ended` / :meth:`prefilled`, then only checked for age."""
        snap = self.snapshots.get(url)
        if snap is None:
            return None, None
        now = time.monotonic() if now is None else now
        if now - snap[3] > STALE_INTERVALS * self.interval_s:
            return None, None
        memo = self._figures.get(url)
        if memo is None:
            memo = self._figures[url] = {}
        got = memo.get(rank)
        if got is None:
            got = memo[rank] = (self._fresh_less(snap, snap[1], self._ended.get(url), rank, now),
                                self._fresh_less(snap, self.waiting.get(url), self._prefilled.get(url), rank, now))
        return got

    def _fresh_less(self, snap, per: dict | None, gone_per: dict | None, rank: int | None,
                    now: float | None) -> int | None:
        """``per[rank]`` (``rank`` None: the sum over ranks) less what this router saw since (``gone_per``),
        floored at 0; None when the snapshot is missing or stale, or the figure was not reported."""
        if snap is None or per is None:
            return None
        now = time.monotonic() if now is None else now
        if now - snap[3] > STALE_INTERVALS * self.interval_s:
            return None
        if rank is None:
            n = sum(per.values())
            gone = sum(gone_per.values()) if gone_per else 0
        else:
            n = per.get(rank)
            if n is None:
                return None
            gone = gone_per.get(rank, 0) if gone_per else 0
        return max(0, n - gone)

    def capacity(self, url: str, rank: int | None) -> int | None:
        """The KV pool size in tokens of a target (``rank`` None: all ranks together); None: unknown.

        A pool's size does not change while the worker runs, so it never goes stale.
        """
        pools = self.pools.get(url)
        if not pools:
            return None
        return sum(pools.values()) if rank is None else pools.get(rank)

    def put(self, url: str, per_rank: dict[int, int], now: float | None = None, asked: float | None = None,
            taken: float | None = None, waiting: dict[int, int] | None = None,
            waiting_reqs: dict[int, int] | None = None, running_only: bool = False) -> None:
        """A new snapshot: ``per_rank`` as reported, arrived ``now``, asked for at ``asked`` (default: ``now``),
        taken by the engine at ``taken`` (monotonic; default: none known, the age counts from ``now``);
        ``waiting``: ``{dp_rank: num_waiting_uncached_tokens}`` and ``waiting_reqs``: ``{dp_rank:
        num_waiting_reqs}`` when the engine reports them; ``running_only``: ``per_rank`` counts the
        running requests' KV alone, not the waiting requests' prompts (vLLM's figures, :func:`vllm_figures`).
        Then :attr:`on_snapshot` is called with ``url``."""
        now = time.monotonic() if now is None else now
        if running_only:
            self.running_only.add(url)
        else:
            self.running_only.discard(url)
        self.snapshots[url] = (now, per_rank, now if asked is None else asked, now if taken is None else min(taken, now))
        self._figures.pop(url, None)
        self._ended.pop(url, None)
        self._prefilled.pop(url, None)
        if waiting:
            self.waiting[url] = waiting
        else:
            self.waiting.pop(url, None)
        if waiting_reqs:
            self.waiting_reqs[url] = waiting_reqs
        else:
            self.waiting_reqs.pop(url, None)
        if self.on_snapshot is not None:
            self.on_snapshot(url)

    def _counted(self, url: str, sent: float, now: float | None) -> bool:
        """Whether the current snapshot of ``url`` counts a request sent at ``sent`` that changed state
        (ended, or finished its prefill) ``now``: it was in flight before the figures were taken (asked
        for, when the engine gave no ``timestamp``) and the change came after the snapshot arrived."""
        snap = self.snapshots.get(url)
        if snap is None:
            return False
        now = time.monotonic() if now is None else now
        cut = snap[2] if snap[3] == snap[0] else snap[3]  # taken, when the engine said; else asked
        return sent < cut and now >= snap[0]

    def counts(self, url: str, sent: float) -> bool:
        """Whether a request sent to ``url`` at ``sent`` that ends now is in the current snapshot's figures
        (so that :meth:`ended` would take it off)."""
        return self._counted(url, sent, None)

    def counts_from(self, url: str) -> float | None:
        """The monotonic time before which a request sent to ``url`` is in its current snapshot's
        figures (when the engine took them; when they were asked for, without ``timestamp``); None
        without a snapshot.  The policy takes the cached prompt tokens of its requests sent before
        then and still in flight off the engine's figure (the engine counts them, the router does not)."""
        snap = self.snapshots.get(url)
        if snap is None:
            return None
        return snap[2] if snap[3] == snap[0] else snap[3]

    def prefilled(self, url: str, rank: int | None, sent: float, tokens: int, now: float | None = None) -> None:
        """A request of this router on ``url``, sent at ``sent``, finished its prefill (its first answer
        bytes arrived, or it ended): when the snapshot counted its ``tokens`` (uncached prompt) as
        waiting, they are taken off :meth:`queued` until the next snapshot (as :meth:`ended` does)."""
        if tokens > 0 and url in self.waiting and self._counted(url, sent, now):
            per = self._prefilled.setdefault(url, {})
            per[rank] = per.get(rank, 0) + tokens
            self._figures.pop(url, None)

    def ended(self, url: str, rank: int | None, sent: float, tokens: int, now: float | None = None) -> None:
        """A request of this router on ``url`` (``rank``; None: the worker chose) ended; it was sent at ``sent``.

        When it was in flight before the current snapshot's figures were taken (asked for, when the
        engine gave no ``timestamp``) and ends after that snapshot arrived, the snapshot counts it
        though it is gone: ``tokens`` (its prompt tokens) are taken
        off the engine's figure until the next snapshot.  Otherwise (sent later, or ended while
        the poll was out) the snapshot may not count it, and nothing is taken off.
        """
        if tokens > 0 and self._counted(url, sent, now):
            per = self._ended.setdefault(url, {})
            per[rank] = per.get(rank, 0) + tokens
            self._figures.pop(url, None)

    def forget(self, url: str) -> None:
        self.snapshots.pop(url, None)
        self._figures.pop(url, None)
        self._ended.pop(url, None)
        self._prefilled.pop(url, None)
        self.waiting.pop(url, None)
        self.waiting_reqs.pop(url, None)
        self._missing.pop(url, None)
        self.pools.pop(url, None)
        self.running_only.discard(url)
        self._via_metrics.discard(url)
        self._oversize.discard(url)
        self._unread.discard(url)
        self.engine_ranks.pop(url, None)

    async def poll(self, router, wait: bool = True) -> None:
        """Ask every registered worker once, concurrently; drop removed workers' snapshots.

        A worker whose previous poll is still out is not asked again.  ``wait=False`` (:meth:`run`): the
        polls go on in the background, so that a slow worker (its timeout is ``max(interval, 0.5 s)``)
        does not hold back the next round of the others, whose figures would then go stale."""
        urls = router.registry.urls()
        for u in [u for u in self.snapshots if u not in urls]:
            self.forget(u)
        now = time.monotonic()
        ask = [u for u in urls if now - self._missing.get(u, -1e9) >= RETRY_MISSING_S and u not in self._asking]
        tasks = [asyncio.ensure_future(self._ask_once(router, u)) for u in ask]
        self._tasks.update(tasks)
        for t in tasks:
            t.add_done_callback(self._tasks.discard)
        if wait and tasks:
            await asyncio.gather(*tasks)

    async def _ask_once(self, router, url: str) -> None:
        self._asking.add(url)
        try:
            await self._ask(router, url)
        finally:
            self._asking.discard(url)

    async def _ask(self, router, url: str) -> None:
        """One poll of ``url``: ``/v1/loads``, or vLLM's ``/metrics`` where it has no ``/v1/loads``."""
        import aiohttp

        self.polls += 1
        asked = time.monotonic()
        timeout = aiohttp.ClientTimeout(total=max(self.interval_s, 0.5))
        per = stamp = waiting = waiting_reqs = None
        running_only = url in self._via_metrics
        try:
            if not running_only:
                async with router.session.get(url + "/v1/loads?include=core", headers=router.own_headers(url),
                                              timeout=timeout) as r:
                    if r.status == 200:
                        try:
                            doc = await r.json(content_type=None)
                            per, stamp, waiting = ranks_tokens(doc), taken_at(doc), ranks_waiting(doc)
                            waiting_reqs = ranks_waiting_reqs(doc)
                            pools = ranks_capacity(doc)
                            if pools:
                                self.pools[url] = pools
                        except ValueError:  # not JSON
                            per = None
            if per is None:  # no /v1/loads figures: vLLM's gauges on its /metrics, if it has them
                async with router.session.get(url + "/metrics", headers=router.own_headers(url),
                                              timeout=timeout) as r:
                    got = None
                    page = await _read_capped(r.content, METRICS_MAX_BYTES) if r.status == 200 else b""
                    if page is None:  # not read further: a page this large is no vLLM server's
                        if url not in self._oversize:
                            self._oversize.add(url)
                            log.warning("kv loads: %s/metrics is over %d bytes; not read for loads", url,
                                        METRICS_MAX_BYTES)
                    elif page:  # parsed off the event loop: a page near the line cap takes ~0.1 s
                        got = await asyncio.to_thread(vllm_figures, page.decode("utf-8", "replace"))
                    if got is None and url not in self._unread:
                        self._unread.add(url)
                        log.info("kv loads: %s answers neither /v1/loads figures nor vLLM's gauges on /metrics "
                                 "(/metrics: HTTP %d); its load is this router's count alone (asked again every "
                                 "%g s)", url, r.status, RETRY_MISSING_S)
                if got is not None:
                    self._unread.discard(url)
                    per, waiting_reqs, self.pools[url] = got
                    ranks = tuple(sorted(per))
                    # DP ranks 0..n-1, at most as many as a dp_size may name (one socket and thread each); else
                    # not its ranks, and ranks learned before go (a failed poll keeps them: ranks do not change)
                    if ranks == tuple(range(len(ranks))) and len(ranks) <= MAX_DP_SIZE:
                        self.engine_ranks[url] = ranks
                    else:
                        self.engine_ranks.pop(url, None)
                    if not running_only:
                        log.info("kv loads: %s has no /v1/loads; its load is read from vLLM's gauges on "
                                 "/metrics (running requests' KV only)", url)
                    self._via_metrics.add(url)
                    running_only = True
                else:
                    self._via_metrics.discard(url)
        except Exception as e:  # unreachable or slow: no figure now; the router-side count is in charge
            log.debug("kv loads: %s: %s", url, type(e).__name__ if not str(e) else e)
            self._drop(url)
            return  # asked again at the next interval
        if url not in router.registry.urls():  # removed while the poll was out: keep nothing of it
            self.forget(url)
            return
        if per is None:  # the worker has neither (404, not JSON, no figures): ask again much later
            self._drop(url)
            self._missing[url] = time.monotonic()
            return
        self._missing.pop(url, None)
        self._unread.discard(url)
        now = time.monotonic()
        taken = None if stamp is None else now - max(0.0, time.time() - stamp)
        self.put(url, per, now, asked=asked, taken=taken, waiting=waiting, waiting_reqs=waiting_reqs,
                 running_only=running_only)

    def _drop(self, url: str) -> None:
        """A poll of ``url`` failed: its snapshot says nothing about now (the pool size is kept)."""
        self.failures += 1
        self.snapshots.pop(url, None)
        self._figures.pop(url, None)
        self._ended.pop(url, None)
        self._prefilled.pop(url, None)
        self.waiting.pop(url, None)
        self.waiting_reqs.pop(url, None)
        self.running_only.discard(url)

    async def run(self, router) -> None:
        """Poll every ``interval_s`` until cancelled; then cancel the polls still out."""
        try:
            while True:
                try:
                    await self.poll(router, wait=False)
                except Exception:  # pragma: no cover - keep polling whatever a worker answers
                    log.exception("kv loads poll failed")
                await asyncio.sleep(self.interval_s)
        finally:
            for t in list(self._tasks):
                t.cancel()
