"""The engines' own token loads (``GET /v1/loads``), to correct ``kv_aware``'s router-side counts.

Every ``--kv-loads-interval-secs`` (default 1 s; 0 turns this off) each worker is
asked ``GET /v1/loads?include=core`` (SGLang's endpoint, ours too; see
docs/load-and-metrics.md).  Of each ``loads[]`` entry the router keeps
``num_total_tokens`` (KV slots held by running requests + the waiting requests'
lengths + the chunked request's rest) per ``dp_rank``.

A snapshot is *fresh* for :data:`STALE_INTERVALS` intervals after it arrived.
While fresh, a target's load in :mod:`.policy` is::

    load_tokens(t) = max(router-side in-flight tokens(t), engine num_total_tokens(t))

The engine's figure covers traffic this router never saw (other router
replicas, direct clients); the router's covers what it sent since the
snapshot.  Either one alone undercounts, so the larger one is used (summed
over ranks for a whole worker; one rank's for a ``--dp-aware`` target).  A
stale or missing snapshot leaves the router-side count alone.  A worker that
answers ``/v1/loads`` with anything but 200 JSON (vLLM; an older engine) is
asked again only every :data:`RETRY_MISSING_S`.
"""

from __future__ import annotations

import asyncio
import logging
import time

log = logging.getLogger("fleetserve.router")

STALE_INTERVALS = 3  # a snapshot older than this many intervals is not used
RETRY_MISSING_S = 10.0


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


class EngineLoads:
    """Worker url -> (monotonic time of the snapshot, {dp_rank: tokens}); polled by :meth:`run`."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.snapshots: dict[str, tuple[float, dict[int, int]]] = {}
        self._missing: dict[str, float] = {}  # url -> when it last failed to answer
        self.polls = 0
        self.failures = 0

    def tokens(self, url: str, rank: int | None, now: float | None = None) -> int | None:
        """The engine's tokens on a target (``rank`` None: all ranks), or None when stale / unknown."""
        snap = self.snapshots.get(url)
        if snap is None:
            return None
        now = time.monotonic() if now is None else now
        if now - snap[0] > STALE_INTERVALS * self.interval_s:
            return None
        per = snap[1]
        if rank is None:
            return sum(per.values())
        return per.get(rank)

    def put(self, url: str, per_rank: dict[int, int], now: float | None = None) -> None:
        self.snapshots[url] = (time.monotonic() if now is None else now, per_rank)

    def forget(self, url: str) -> None:
        self.snapshots.pop(url, None)
        self._missing.pop(url, None)

    async def poll(self, router) -> None:
        """Ask every registered worker once, concurrently; drop removed workers' snapshots."""
        urls = router.registry.urls()
        for u in [u for u in self.snapshots if u not in urls]:
            self.forget(u)
        now = time.monotonic()
        ask = [u for u in urls if now - self._missing.get(u, -1e9) >= RETRY_MISSING_S]
        await asyncio.gather(*(self._ask(router, u) for u in ask))

    async def _ask(self, router, url: str) -> None:
        import aiohttp

        self.polls += 1
        per = None
        try:
            timeout = aiohttp.ClientTimeout(total=max(self.interval_s, 0.5))
            async with router.session.get(url + "/v1/loads?include=core", timeout=timeout) as r:
                if r.status == 200:
                    per = ranks_tokens(await r.json(content_type=None))
        except Exception as e:  # unreachable, slow, not JSON: the router-side count stays in charge
            log.debug("kv loads: %s/v1/loads: %s", url, e)
        if per is None:
            self.failures += 1
            self._missing[url] = time.monotonic()
            return
        self._missing.pop(url, None)
        self.put(url, per)

    async def run(self, router) -> None:
        while True:
            try:
                await self.poll(router)
            except Exception:  # pragma: no cover - keep polling whatever a worker answers
                log.exception("kv loads poll failed")
            await asyncio.sleep(self.interval_s)
