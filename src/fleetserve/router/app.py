"""The router's handlers and its proxy path (served by :mod:`.server` on uvloop).

Endpoints (as sglang-router):

* ``POST /generate``, ``/v1/completions``, ``/v1/chat/completions``: routed by
  the policy and proxied; the client's body bytes are forwarded unchanged;
  ``"stream": true`` responses are passed through chunk by chunk.
* ``GET /v1/models``, ``/get_model_info``, ``/get_server_info``: from one
  available worker.  ``POST /flush_cache``: to every worker.
* ``GET /health`` (the router is up), ``GET /readiness`` (some worker can take
  a request), ``GET /metrics`` (Prometheus).
* ``POST /add_worker?url=``, ``POST /remove_worker?url=``, ``GET /list_workers``.

Errors are OpenAI-style JSON ``{"error": {"message", "type", "param", "code"}}``:
400 malformed JSON, 413 body over ``--max-payload-size``, 503 no available
worker, 502 every attempt failed without a worker response.

Retries: a connection error, a timeout or a 5xx answer is retried on another
worker (when there is one) after an exponential backoff with jitter, up to
``--retry-max-retries`` attempts -- only while nothing has been sent to the
client.  Once a streamed response has started, a failure ends the stream.
A 4xx answer passes through unchanged and counts as a worker success.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
import orjson

from . import health
from .circuit_breaker import CircuitBreaker
from .config import RouterConfig
from .metrics import RouterStats, make_registry, render
from .policies import make_policy
from .retry import backoff_delay_s
from .routing_text import routing_text
from .http.server import Request, Response, Routes, json_error
from .http.client import UpstreamError, UpstreamPool, UpstreamResponse, UpstreamTimeoutError
from .workers import Worker, WorkerRegistry, normalize_url

log = logging.getLogger("fleetserve.router")

INFERENCE_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")
_UPSTREAM_ERRORS = (UpstreamError, aiohttp.ClientError, asyncio.TimeoutError, OSError)
_JSON = "application/json"
# response headers not passed back to the client: hop-by-hop ones, and the ones the server writes itself
_NOT_FORWARDED = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "content-type",
                            "proxy-connection", "te", "trailer", "upgrade"})


def _forwarded_headers(resp: UpstreamResponse) -> list[tuple[str, str]]:
    """The worker's response headers to pass to the client (e.g. a worker id header), as pairs, repeats kept."""
    return [(k, v) for k, v in resp.header_pairs if k not in _NOT_FORWARDED]


class _Retry:
    """This attempt failed by the worker's fault; ``response`` is what the client gets if no retry is left."""

    __slots__ = ("response",)

    def __init__(self, response: Response) -> None:
        self.response = response


class Router:
    """Router state (workers, policy, upstream clients) and the request handlers."""

    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.registry = WorkerRegistry()
        self.policy = make_policy(cfg.policy, cfg)
        self.stats = RouterStats()
        self.metrics_registry = make_registry(self)
        self.session: aiohttp.ClientSession | None = None  # control traffic: health, info, flush
        self.pool: UpstreamPool | None = None  # the proxy path
        self._tasks: list[asyncio.Task] = []
        self._max_attempts = cfg.max_attempts
        self._rr_info = 0
        self._handling = 0  # inference requests being handled (the shutdown drain waits for them)

    # ------------------------------------------------------------ lifecycle
    def inflight(self) -> int:
        """Inference requests being handled, whichever worker (registered or removed since) serves them."""
        return self._handling

    def new_worker(self, url: str) -> Worker:
        c = self.cfg
        breaker = CircuitBreaker(c.cb_failure_threshold, c.cb_success_threshold, c.cb_timeout_duration_secs,
                                 c.cb_window_duration_secs, enabled=not c.disable_circuit_breaker)
        return Worker(normalize_url(url), breaker)

    async def start(self) -> None:
        """Open the HTTP clients and start the background tasks (no worker wait)."""
        self.pool = UpstreamPool(self.cfg.request_timeout_secs)
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=None, keepalive_timeout=60)
        self.session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=self.cfg.request_timeout_secs),
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
        )
        if not self.cfg.disable_health_check:
            self._tasks.append(asyncio.create_task(self._health_loop()))
        if getattr(self.policy, "tree", None) is not None:
            self._tasks.append(asyncio.create_task(self._eviction_loop()))

    async def stop(self) -> None:
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
        urls = [normalize_url(u) for u in c.worker_urls]
        if c.disable_health_check:
            oks = [True] * len(urls)
        else:
            oks = await asyncio.gather(*(
                health.wait_healthy(self.session, u, c.health_check_endpoint, c.worker_startup_timeout_secs,
                                    c.worker_startup_check_interval, c.health_check_timeout_secs) for u in urls))
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
                                       c.health_success_threshold)
            except Exception:  # pragma: no cover - keep checking whatever happens
                log.exception("health check round failed")

    async def _eviction_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.eviction_interval_secs)
            dropped = self.policy.tree.evict(self.cfg.max_tree_size)
            if dropped:
                log.info("evicted %d chars from the routing tree", dropped)

    # ----------------------------------------------------------- the routes
    def make_routes(self) -> Routes:
        routes = Routes()
        for path in INFERENCE_PATHS:
            routes.add("POST", path, self.handle_inference)
        for path in ("/v1/models", "/get_model_info", "/get_server_info"):
            routes.add("GET", path, self.handle_info)
        routes.add("POST", "/flush_cache", self.handle_flush_cache)
        routes.add("GET", "/health", self.handle_health)
        routes.add("GET", "/readiness", self.handle_readiness)
        routes.add("GET", "/metrics", self.handle_metrics)
        routes.add("POST", "/add_worker", self.handle_add_worker)
        routes.add("POST", "/remove_worker", self.handle_remove_worker)
        routes.add("GET", "/list_workers", self.handle_list_workers)
        return routes

    # ------------------------------------------------------- proxy handlers
    async def handle_inference(self, request: Request) -> Response | None:
        """Parse, route and proxy one inference request (the server already enforced the size limit)."""
        try:
            body = orjson.loads(request.body)
        except orjson.JSONDecodeError as e:
            self.stats.bad_requests += 1
            return json_error(400, f"malformed JSON body: {e}")
        if type(body) is not dict:
            self.stats.bad_requests += 1
            return json_error(400, "the request body must be a JSON object")
        path = request.path
        self._handling += 1
        try:
            return await self._forward(request, path, routing_text(path, body), body.get("stream") is True)
        finally:
            self._handling -= 1

    async def _forward(self, request: Request, path: str, text: str, stream: bool) -> Response | None:
        cfg = self.cfg
        stats = self.stats
        policy = self.policy
        auth = request.headers.get("authorization")
        headers = b"" if auth is None else b"Authorization: " + auth.encode("latin-1") + b"\r\n"
        tried: list[Worker] = []
        failure: Response | None = None
        attempt = 0
        while True:
            attempt += 1
            t0 = time.perf_counter()
            workers = self.registry.available()
            if tried and len(workers) > 1:
                fresh = [w for w in workers if w not in tried]
                if fresh:
                    workers = fresh
            worker = policy.select(workers, text, retry=bool(tried))
            stats.observe_decision(time.perf_counter() - t0)
            if worker is None:
                stats.no_worker += 1
                if failure is None:
                    return json_error(503, "no healthy worker available", "service_unavailable")
                return failure
            result = await self._attempt(request, worker, path, headers, stream)
            if type(result) is not _Retry:
                return result
            tried.append(worker)
            failure = result.response
            if attempt >= self._max_attempts:
                return failure
            stats.retries += 1
            await asyncio.sleep(backoff_delay_s(attempt, cfg.retry_initial_backoff_ms, cfg.retry_max_backoff_ms,
                                                cfg.retry_backoff_multiplier, cfg.retry_jitter_factor))

    async def _attempt(self, request: Request, worker: Worker, path: str, headers: bytes, stream: bool):
        """One upstream attempt: the client's response, None once streamed, or a :class:`_Retry`.

        ``worker.load`` is held from before the send until this returns, whatever happens
        (answer, error, timeout, or cancellation when the client goes away).
        """
        worker.load += 1
        worker.requests += 1
        resp = None
        try:
            try:
                resp = await self.pool.post(worker.url, path, request.body, headers)
                status = resp.status
                if status >= 500:
                    data = await resp.read()
                    self._fail(worker)
                    return _Retry(Response(status, data, resp.headers.get("content-type", _JSON),
                                           _forwarded_headers(resp)))
                if not stream or resp.content_type != "text/event-stream":
                    data = await resp.read()
                    worker.breaker.record_success()
                    return Response(status, data, resp.headers.get("content-type", _JSON),
                                    _forwarded_headers(resp))
            except UpstreamError as e:
                self._fail(worker)
                status, kind = (504, "gateway_timeout") if isinstance(e, UpstreamTimeoutError) else (502, "bad_gateway")
                return _Retry(json_error(status, f"upstream request to {worker.url} failed: {type(e).__name__}: {e}",
                                         kind))
            # streaming: from here on bytes reach the client, so no retry
            await self._stream(request, worker, resp)
            return None
        finally:
            worker.load -= 1
            if resp is not None:
                resp.release()

    async def _stream(self, request: Request, worker: Worker, resp: UpstreamResponse) -> None:
        """Pass a streamed answer through chunk by chunk, as each arrives."""
        try:
            extra = _forwarded_headers(resp)
            if "cache-control" not in resp.headers:
                extra.append(("Cache-Control", "no-cache"))
            request.start_stream(resp.status, resp.headers.get("content-type", "text/event-stream"), extra)
            tail = b"\n\n"  # the last two bytes sent: is an event open?
            try:
                while True:
                    chunk = await resp.next_chunk()
                    if not chunk:
                        break
                    await request.write(chunk)
                    tail = (tail + chunk)[-2:]
            except UpstreamError as e:
                # bytes already reached the client, so no retry: close off any half event and
                # end with an OpenAI-style error event (and no [DONE]) rather than a silent cut
                self._fail(worker)
                err = {"error": {"message": f"worker {worker.url} failed mid-stream: {e}", "type": "bad_gateway",
                                 "code": 502}}
                await request.write((b"" if tail == b"\n\n" else b"\n\n") + b"data: " + orjson.dumps(err)
                                    + b"\n\n")
                request.end_stream()
                return
            worker.breaker.record_success()
            request.end_stream()
        except ConnectionResetError:
            pass  # the client went away; _attempt's finally releases the worker

    @staticmethod
    def _fail(worker: Worker) -> None:
        worker.failures += 1
        worker.breaker.record_failure()

    # ------------------------------------------------------- info handlers
    async def handle_info(self, request: Request) -> Response:
        workers = self.registry.available()
        if not workers:
            return json_error(503, "no healthy worker available", "service_unavailable")
        last = None
        for i in range(len(workers)):
            worker = workers[(self._rr_info + i) % len(workers)]
            try:
                async with self.session.get(worker.url + request.path,
                                            timeout=aiohttp.ClientTimeout(total=30)) as resp:
                    data = await resp.read()
                    if resp.status < 500:
                        self._rr_info += 1
                        return Response(resp.status, data, resp.headers.get("Content-Type", _JSON))
                    last = f"{worker.url} answered {resp.status}"
            except _UPSTREAM_ERRORS as e:
                last = f"{worker.url}: {type(e).__name__}"
        return json_error(502, f"no worker answered {request.path}: {last}", "bad_gateway")

    async def handle_flush_cache(self, request: Request) -> Response:
        workers = list(self.registry.workers)

        async def one(w: Worker):
            try:
                async with self.session.post(w.url + "/flush_cache", timeout=aiohttp.ClientTimeout(total=30)) as r:
                    await r.read()
                    return r.status
            except _UPSTREAM_ERRORS as e:
                return f"{type(e).__name__}"

        results = await asyncio.gather(*(one(w) for w in workers))
        per = {w.url: s for w, s in zip(workers, results)}
        ok = all(isinstance(s, int) and s < 300 for s in results)
        return Response(200 if ok else 500, orjson.dumps({"success": ok, "workers": per}))

    async def handle_health(self, request: Request) -> Response:
        return Response(200, b'{"status":"ok"}')

    async def handle_readiness(self, request: Request) -> Response:
        n = len(self.registry.available())
        body = orjson.dumps({"ready": n > 0, "available_workers": n, "workers": len(self.registry)})
        return Response(200 if n else 503, body)

    async def handle_metrics(self, request: Request) -> Response:
        return Response(200, render(self.metrics_registry), "text/plain; version=0.0.4; charset=utf-8")

    # --------------------------------------------------- worker management
    async def handle_add_worker(self, request: Request) -> Response:
        raw = request.query.get("url")
        if not raw:
            return json_error(400, "missing ?url= query parameter")
        try:
            url = normalize_url(raw)
        except ValueError as e:
            return json_error(400, f"bad worker url: {e}")
        if self.registry.get(url) is not None:
            return json_error(400, f"worker {url} is already registered")
        c = self.cfg
        if not c.disable_health_check:
            ok = await health.wait_healthy(self.session, url, c.health_check_endpoint,
                                           c.worker_startup_timeout_secs, c.worker_startup_check_interval,
                                           c.health_check_timeout_secs)
            if not ok:
                return json_error(503, f"worker {url} did not become healthy within "
                                       f"{c.worker_startup_timeout_secs} s", "service_unavailable")
        if not self.registry.add(self.new_worker(url)):
            return json_error(400, f"worker {url} is already registered")
        log.info("added worker %s", url)
        return Response(200, orjson.dumps({"success": True, "message": f"added worker {url}"}))

    async def handle_remove_worker(self, request: Request) -> Response:
        raw = request.query.get("url")
        if not raw:
            return json_error(400, "missing ?url= query parameter")
        try:
            worker = self.registry.remove(raw)
        except ValueError as e:
            return json_error(400, f"bad worker url: {e}")
        if worker is None:
            return json_error(404, f"worker {raw} is not registered", "not_found_error")
        self.policy.on_worker_removed(worker.url)
        self.pool.forget(worker.url)
        log.info("removed worker %s (%d requests still in flight)", worker.url, worker.load)
        return Response(200, orjson.dumps({"success": True, "message": f"removed worker {worker.url}"}))

    async def handle_list_workers(self, request: Request) -> Response:
        body = {
            "urls": self.registry.urls(),
            "workers": [{"url": w.url, "healthy": w.healthy, "load": w.load, "circuit": w.breaker.state}
                        for w in self.registry.workers],
        }
        return Response(200, orjson.dumps(body))
