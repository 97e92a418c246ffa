"""Which KV-event streams to subscribe to, kept in step with the router's workers.

A worker's streams come from ``--kv-events-endpoint WORKER_URL=tcp://HOST:PORT``
(repeatable; for vLLM, which has no ``/get_server_info``) or else from its
``GET /get_server_info`` (SGLang and ours): ``kv_events_config`` (a JSON
string, or an object) with ``endpoint``, optional ``replay_endpoint`` and
``topic``, and ``dp_size`` (or ``data_parallel_size``).  A wildcard host
(``*``, ``0.0.0.0``, ``::``) means the worker's own host, and DP rank ``r``
publishes on the endpoint's port ``+ r`` (the ``offset_endpoint_port`` rule of
vLLM and SGLang); the replay endpoint is offset the same way.

:meth:`KvEventSources.sync` runs every :data:`SYNC_INTERVAL_S`: workers added
at run time are subscribed, removed ones are unsubscribed and their entries
dropped.  A worker whose info has no KV-event config is asked again every
:data:`REDISCOVER_S`; until then it is routed by the approximate tree.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from urllib.parse import urlsplit

import zmq

from .subscriber import Subscription

log = logging.getLogger("fleetserve.router")

SYNC_INTERVAL_S = 1.0
REDISCOVER_S = 10.0
# the most DP ranks of one worker this router subscribes to (one socket and one thread per rank) or routes
# as targets: above it the worker's dp_size is taken as a misreport (SGLang's largest DP-attention groups
# are tens to a few hundred ranks), so a worker cannot make the router open thousands of sockets
MAX_DP_SIZE = 256
_WILDCARDS = ("*", "0.0.0.0", "::", "[::]", "")


def _reported_dp(info: dict):
    """The DP size ``/get_server_info`` reports (``dp_size``, else ``data_parallel_size``), None if neither."""
    dp = info.get("dp_size")
    return info.get("data_parallel_size") if dp is None else dp


def dp_size_of(info: dict) -> int | None:
    """``/get_server_info``'s DP size: an int in ``1..MAX_DP_SIZE``, 1 when not reported; None when it is
    reported but not such a number (see :func:`bad_dp_size`)."""
    dp = _reported_dp(info)
    if dp is None:
        return 1
    return dp if type(dp) is int and 1 <= dp <= MAX_DP_SIZE else None


def bad_dp_size(info: dict) -> str:
    """Why :func:`dp_size_of` refused the worker's DP size, for the router's warning."""
    dp = _reported_dp(info)
    return (f"its /get_server_info dp_size {dp!r} is not a whole number in 1..{MAX_DP_SIZE} (the most ranks this "
            f"router subscribes to)")


def parse_endpoint_flags(values: list[str]) -> dict[str, str]:
    """``WORKER_URL=tcp://HOST:PORT`` items -> {normalized url: endpoint}; raises ``ValueError`` naming the item."""
    from ..workers import normalize_url

    out = {}
    for v in values or []:
        url, sep, ep = v.partition("=")
        if not sep or not ep.startswith("tcp://") or ":" not in ep[len("tcp://"):]:
            raise ValueError(f"--kv-events-endpoint {v!r}: give WORKER_URL=tcp://HOST:PORT")
        try:
            port = int(ep.rsplit(":", 1)[1])
        except ValueError:
            port = 0
        if not 1 <= port <= 65535:
            raise ValueError(f"--kv-events-endpoint {v!r}: the port must be in 1..65535")
        out[normalize_url(url)] = ep
    return out


def rank_endpoint(endpoint: str, worker_url: str, rank: int) -> str:
    """``endpoint`` with a wildcard host replaced by the worker's host and the port offset by ``rank``."""
    if not endpoint.startswith("tcp://"):
        return endpoint if rank == 0 else f"{endpoint}_dp{rank}"  # ipc/inproc: vLLM's suffix rule
    hostport = endpoint[len("tcp://"):]
    host, _, port = hostport.rpartition(":")
    if host in _WILDCARDS:
        h = urlsplit(worker_url).hostname or "127.0.0.1"
        host = f"[{h}]" if ":" in h else h
    try:
        p = int(port)
    except ValueError:
        p = -1
    if not 1 <= p or p + rank > 65535:
        raise ValueError(f"KV-event endpoint {endpoint!r}: " + (
            f"port {port!r} is not a number in 1..65535" if not 1 <= p <= 65535 else
            f"DP rank {rank} would publish on port {p + rank}, over 65535"))
    return f"tcp://{host}:{p + rank}"


def _events_config(info: dict) -> dict | None:
    """``/get_server_info``'s ``kv_events_config`` (an object or its JSON text) when it names an ``endpoint``."""
    cfg = info.get("kv_events_config")
    if isinstance(cfg, str):
        try:
            cfg = json.loads(cfg)
        except ValueError:
            return None
    return cfg if isinstance(cfg, dict) and isinstance(cfg.get("endpoint"), str) else None


def endpoints_from_info(info: dict, worker_url: str) -> list[tuple[int, str, str | None, str]] | None:
    """``(rank, endpoint, replay_endpoint, topic)`` per DP rank from ``/get_server_info``; None without config.
    Raises ``ValueError`` naming the field when the config's endpoints or the DP size are unusable
    (:func:`rank_endpoint`, :func:`dp_size_of`)."""
    cfg = _events_config(info)
    if cfg is None:
        return None
    if cfg.get("publisher", "zmq") not in ("zmq",):
        return None
    dp = dp_size_of(info)
    if dp is None:
        raise ValueError(bad_dp_size(info))
    replay = cfg.get("replay_endpoint") if isinstance(cfg.get("replay_endpoint"), str) else None
    topic = cfg.get("topic") if isinstance(cfg.get("topic"), str) else ""
    return [(r, rank_endpoint(cfg["endpoint"], worker_url, r),
             rank_endpoint(replay, worker_url, r) if replay else None, topic) for r in range(dp)]


def unpublished_reason(info: dict) -> str:
    """Why :func:`endpoints_from_info` found no stream in ``/get_server_info``, for the router's warning."""
    cfg = info.get("kv_events_config")
    if cfg is None:
        return "no kv_events_config in its /get_server_info"
    if isinstance(cfg, str):
        try:
            cfg = json.loads(cfg)
        except ValueError:
            return "its kv_events_config is not JSON"
    if not isinstance(cfg, dict):
        return "its kv_events_config is not an object"
    publisher = cfg.get("publisher", "zmq")
    if publisher != "zmq":
        return f"its kv_events_config names publisher {publisher!r}, which publishes nothing to subscribe to"
    return "its kv_events_config names no endpoint"


def connecting_endpoint(info: dict) -> str | None:
    """The worker's ``tcp://`` publisher endpoint from ``/get_server_info`` when it names a host (not a
    wildcard): such a PUB socket connects to a collector instead of binding (vLLM's and SGLang's rule,
    docs/kv_events.md), so a router that subscribes there, connecting too, receives nothing unless
    something else binds the address.  None for a wildcard host, ``ipc://`` / ``inproc://`` or no config."""
    cfg = _events_config(info)
    ep = cfg["endpoint"] if cfg is not None else None
    if ep is None or not ep.startswith("tcp://"):
        return None
    host = ep[len("tcp://"):].rpartition(":")[0]
    return None if host in _WILDCARDS else ep


class KvEventSources:
    """The subscriptions of a :class:`~.policy.KvAwarePolicy`, in step with the worker registry."""

    def __init__(self, policy, flag_endpoints: dict[str, str] | None = None) -> None:
        self.policy = policy
        self.flag_endpoints = flag_endpoints or {}
        self.ctx = zmq.Context()
        self._asked: dict[str, float] = {}  # url -> when its info was last asked for (no config found)
        self._told: set[str] = set()  # urls already logged as naming no publisher (once per registration)
        self._why: dict[str, str] = {}  # url -> why its last /get_server_info gave nothing (e.g. "answered 401")
        self._connects: dict[str, str] = {}  # url -> its publisher endpoint, when that connects (connecting_endpoint)
        self._unpublished: dict[str, str] = {}  # url -> why its /get_server_info names no stream (unpublished_reason)
        # url -> ranks subscribed from --kv-events-endpoint for a worker that reported no dp_size (vLLM): when its
        # /metrics later names another number of DP ranks (EngineLoads.engine_ranks), it is subscribed again at those
        self._guessed: dict[str, int] = {}

    async def run(self, router) -> None:
        """Sync every :data:`SYNC_INTERVAL_S` until cancelled; then end every subscription."""
        try:
            while True:
                try:
                    await self.sync(router)
                except Exception:  # pragma: no cover - keep syncing whatever a worker answers
                    log.exception("kv-events sync failed")
                await asyncio.sleep(SYNC_INTERVAL_S)
        finally:
            self.close()

    async def sync(self, router) -> None:
        policy = self.policy
        urls = set(router.registry.urls())
        for url in [u for u in policy.subs if u not in urls]:
            self.unsubscribe(url)
        for url in [u for u in policy.dp_ranks if u not in urls]:
            del policy.dp_ranks[url]
        loads = policy.engine_loads
        for url, n in list(self._guessed.items()):  # a vLLM server's ranks, learned from its /metrics since
            learned = loads.engine_ranks.get(url) if loads is not None else None
            if url in policy.subs and learned and len(learned) != n:  # more engines, or fewer
                log.info("kv-events: %s names %d DP ranks on its /metrics (engine labels), not %d: subscribing "
                         "to each", url, len(learned), n)
                self.unsubscribe(url)
                self._asked.pop(url, None)
        self._told &= urls  # a removed worker added again is told about again
        for url in urls - set(policy.subs):
            if time.monotonic() - self._asked.get(url, -1e9) < REDISCOVER_S:
                continue
            try:
                eps = await self.discover(router, url)
            except ValueError as e:  # its config names endpoints or a DP size that cannot be used
                self._asked[url] = time.monotonic()
                if url not in self._told:  # once per registration; the other workers go on
                    self._told.add(url)
                    log.warning("kv-events: %s: %s; routed on the approximate tree (branch=fallback)", url, e)
                continue
            if url not in set(router.registry.urls()) or url in policy.subs:
                continue  # removed (or subscribed) during the wait
            if not eps:
                self._asked[url] = time.monotonic()
                why = self._why.pop(url, None)
                if url not in self._told:  # else a user sees branch=fallback with no reason anywhere
                    self._told.add(url)
                    if why is None:
                        log.warning("kv-events: %s names no KV-event publisher (%s, no --kv-events-endpoint for "
                                    "it): routed on the approximate tree (branch=fallback) until it does; start it "
                                    "with --kv-events-config", url, self._unpublished.pop(url, "no stream"))
                    else:
                        log.warning("kv-events: %s/get_server_info %s, so its KV-event publisher is unknown: "
                                    "routed on the approximate tree (branch=fallback); name it with "
                                    "--kv-events-endpoint %s=tcp://HOST:PORT", url, why, url)
                continue
            self._asked.pop(url, None)
            subs = {}
            loop = asyncio.get_running_loop()

            def on_lost(target, loop=loop):  # from the subscription's thread: the tree lives on the loop
                loop.call_soon_threadsafe(policy.forget_cached, *target)

            for rank, ep, replay, topic in eps:
                s = Subscription(url, rank, ep, policy.index, replay, topic, self.ctx, on_lost)
                s.start()
                subs[rank] = s
            policy.subs[url] = subs
            log.info("kv-events: %s subscribed: %s", url,
                     ", ".join(f"rank {r} {ep}" + (f" (replay {rp})" if rp else "") for r, ep, rp, _ in eps))
            connects = self._connects.pop(url, None)
            if connects is not None:  # subscribed, but both ends connect: say so once, at subscription
                port = connects.rpartition(":")[2]
                log.warning("kv-events: %s publishes on %s, a named host, so its PUB socket connects to a "
                            "collector there instead of binding (as vLLM and SGLang do); this router connects too "
                            "and receives nothing unless something binds that address: start the worker with "
                            "tcp://*:%s to publish to routers directly", url, connects, port)

    async def discover(self, router, url: str):
        """The worker's streams: from the flag, else from its ``/get_server_info`` (None when it has none)."""
        info = None
        self._why.pop(url, None)
        try:
            import aiohttp

            async with router.session.get(url + "/get_server_info", headers=router.own_headers(url),
                                          timeout=aiohttp.ClientTimeout(total=5)) as r:
                if r.status == 200:
                    info = await r.json(content_type=None)
                else:  # e.g. 401 from a worker started with --api-key while the router has none or another
                    self._why[url] = f"answered {r.status}"
        except Exception as e:  # unreachable, not JSON, ...: ask again later
            log.debug("kv-events: %s/get_server_info: %s", url, e)
            self._why[url] = f"failed ({type(e).__name__})"
        if not isinstance(info, dict):
            info = {}
        dp = dp_size_of(info)
        if dp is None:  # a misreport: rank 0 alone for --dp-aware, and no streams (the caller warns)
            self.policy.dp_ranks.pop(url, None)
            raise ValueError(bad_dp_size(info))
        if _reported_dp(info) is not None:  # its ranks for --dp-aware, should it publish no events (policy.ranks)
            self.policy.dp_ranks[url] = tuple(range(dp))
        queue = self.policy.router_queue
        if queue is not None and self._why.get(url) is None:  # its prefill budget (--router-queue-threshold)
            queue.learned(url, info)
        ep = self.flag_endpoints.get(url)
        self._connects.pop(url, None)
        connects = connecting_endpoint(info) if ep is None else None
        if connects is not None:
            self._connects[url] = connects
        if ep is not None:
            if _reported_dp(info) is None:  # vLLM: its ranks from the engine labels of its /metrics, once known
                loads = self.policy.engine_loads
                learned = loads.engine_ranks.get(url) if loads is not None else None
                dp = len(learned) if learned else 1
                self._guessed[url] = dp
            return [(r, rank_endpoint(ep, url, r), None, "") for r in range(dp)]
        eps = endpoints_from_info(info, url)
        if eps is None:
            self._unpublished[url] = unpublished_reason(info)
        return eps

    def unsubscribe(self, url: str) -> None:
        subs = self.policy.subs.pop(url, {})
        for s in subs.values():
            s.stop(timeout=0.5)
        if self.policy.router_queue is not None:
            self.policy.router_queue.forget(url)
        self.policy.index.drop_worker(url)
        self._asked.pop(url, None)
        self._told.discard(url)
        self._guessed.pop(url, None)
        if subs:
            log.info("kv-events: %s unsubscribed", url)

    def close(self) -> None:
        for url in list(self.policy.subs):
            subs = self.policy.subs.pop(url)
            for s in subs.values():
                s._stop.set()
            for s in subs.values():
                s.stop(timeout=1.0)
        self.policy.close()
