"""The router's state and its lifecycle.

A :class:`Router` holds the settings, the worker registry, the routing policy,
the counters behind ``/metrics``, and the two HTTP clients: the lean
:class:`~.http.client.UpstreamPool` for the proxy path and an aiohttp session
for control traffic (health checks, info, cache flush).  It opens and closes
them, registers the ``--worker-urls`` workers once healthy, and runs the
background health checks and the routing tree's eviction.

What is served over that state: :mod:`.proxy` (inference), :mod:`.admin`
(everything else), put on paths by :mod:`.routes`.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from . import health
from .auth import own_headers, worker_headers
from .admission import make_admission
from .circuit_breaker import CircuitBreaker
from .config import RouterConfig
from .metrics import RouterStats, make_registry
from .prediction import Predictions
from .policies import make_policy
from .sessions import StickySessions
from .via import new_pseudonym
from .http.client import UpstreamPool
from .workers import Worker, WorkerRegistry, normalize_url

log = logging.getLogger("fleetserve.router")


class Router:
    """The router's state (workers, policy, counters, HTTP clients) and its start and stop."""

    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.registry = WorkerRegistry()
        self.policy = make_policy(cfg.policy, cfg)
        self.sessions = StickySessions.from_config(cfg) if cfg.sticky_sessions else None  # --sticky-sessions
        self.stats = RouterStats()
        self.predictions = Predictions()  # predicted vs engine-reported cached tokens, per worker (prediction.py)
        self.metrics_registry = make_registry(self)
        self.session: aiohttp.ClientSession | None = None  # control traffic: health, info, flush
        self.pool: UpstreamPool | None = None  # the proxy path
        self._tasks: list[asyncio.Task] = []
        self.pending: dict[str, asyncio.Task] = {}  # /add_worker urls waiting for their first good health check
        self.starting: list[str] = []  # --worker-urls still waited for at start-up (add_initial_workers)
        self.max_attempts = cfg.max_attempts  # a computed config property, copied once
        self.info_turn = 0  # which available worker answers the next info request
        self.handling = 0  # inference requests being handled (the shutdown drain waits for them)
        self.admission = make_admission(cfg)  # None: --max-concurrent-requests -1
        self.drains: dict[str, asyncio.Task] = {}  # POST /drain_worker waits, by url
        self.shutting_down = False  # set on SIGTERM/SIGINT: /readiness answers 503
        self.via = new_pseudonym()  # this router's Via entry, on every request it sends a worker (via.py)

    def inflight(self) -> int:
        """Inference requests being handled or queued for admission, whichever worker serves them."""
        return self.handling + (self.admission.queued if self.admission is not None else 0)

    def new_worker(self, url: str, api_key: str | None = None) -> Worker:
        c = self.cfg
        breaker = CircuitBreaker(c.cb_failure_threshold, c.cb_success_threshold, c.cb_timeout_duration_secs,
                                 c.cb_window_duration_secs, enabled=not c.disable_circuit_breaker)
        return Worker(normalize_url(url), breaker, api_key)

    def own_headers(self, url: str) -> dict[str, str]:
        """Headers for the router's own request to registered ``url``: its own key if it has one, else
        ``{}`` (the session's ``--api-key`` default applies; auth.py)."""
        w = self.registry.get(url)
        return own_headers(w.api_key if w is not None else None)

    async def start(self) -> None:
        """Open the HTTP clients and start the background tasks (no worker wait)."""
        self.pool = UpstreamPool(self.cfg.request_timeout_secs)
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=None, keepalive_timeout=60)
        self.session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=self.cfg.request_timeout_secs),
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
            # --api-key is the workers' key too (auth.py); Via names this router, so a loop is seen (via.py)
            headers={**worker_headers(self.cfg.api_key), "Via": self.via},
        )
        if not self.cfg.disable_health_check:
            self._tasks.append(asyncio.create_task(self._health_loop()))
        if getattr(self.policy, "tree", None) is not None:
            self._tasks.append(asyncio.create_task(self._eviction_loop()))
        if getattr(self.policy, "index", None) is not None:  # kv_aware: follow the workers' KV events
            from .kv_events.sources import KvEventSources, parse_endpoint_flags
            self.kv_sources = KvEventSources(self.policy, parse_endpoint_flags(self.cfg.kv_events_endpoint))
            if self.policy.router_queue is not None:  # --router-queue-threshold: its busy test's targets
                self.policy.router_queue.available = self.registry.available
            self._tasks.append(asyncio.create_task(self.kv_sources.run(self)))
            if self.cfg.kv_loads_interval_secs > 0:  # the engines' own token loads (kv_events/loads.py)
                from .kv_events.loads import EngineLoads
                self.policy.engine_loads = EngineLoads(self.cfg.kv_loads_interval_secs)
                self._tasks.append(asyncio.create_task(self.policy.engine_loads.run(self)))

    async def stop(self) -> None:
        for t in (*self.pending.values(), *self.drains.values()):
            t.cancel()
        await asyncio.gather(*self.pending.values(), *self.drains.values(), return_exceptions=True)
        self.pending.clear()
        self.drains.clear()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        self._tasks.clear()
        if self.session is not None:
            await self.session.close()
        if self.pool is not None:
            self.pool.close()

    async def add_initial_workers(self) -> list[str]:
        """Wait for every ``--worker-urls`` worker to be healthy and register it; return the ones that never were."""
        c = self.cfg
        urls = []
        for raw in c.worker_urls:
            u = normalize_url(raw)
            if u in urls:
                log.warning("--worker-urls names %s more than once: it is one worker", u)
            else:
                urls.append(u)
        if c.disable_health_check:
            oks = [True] * len(urls)
        else:
            self.starting = list(urls)

            async def wait(u: str) -> bool:
                ok = await health.wait_healthy(self.session, u, c.health_check_endpoint, c.worker_startup_timeout_secs,
                                               c.worker_startup_check_interval, c.health_check_timeout_secs)
                if ok:
                    self.starting.remove(u)
                return ok

            oks = await asyncio.gather(*(wait(u) for u in urls))
        failed = []
        for u, ok in zip(urls, oks):
            if ok:
                self.registry.add(self.new_worker(u))
            else:
                failed.append(u)
        return failed

    async def _health_loop(self) -> None:
        c = self.cfg
        while True:
            await asyncio.sleep(c.health_check_interval_secs)
            try:
                await health.check_all(self.session, list(self.registry.workers), c.health_check_endpoint,
                                       c.health_check_timeout_secs, c.health_failure_threshold,
                                       c.health_success_threshold, self.via)
            except Exception:  # pragma: no cover - keep checking whatever happens
                log.exception("health check round failed")

    async def _eviction_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.eviction_interval_secs)
            dropped = self.policy.tree.evict(self.cfg.max_tree_size)
            if dropped:
                log.info("evicted %d chars from the routing tree", dropped)
