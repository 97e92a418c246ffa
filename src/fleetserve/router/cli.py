"""``fleetserve router``: parse flags, wait for the workers, serve until SIGINT/SIGTERM.

On SIGINT/SIGTERM it stops accepting connections and waits up to
``--shutdown-grace-period-secs`` for the requests in flight to finish; a second
signal ends that wait at once (as a second Ctrl-C does in uvicorn).

Exit codes: 0 after a clean stop, 1 if ``--port`` (or ``--prometheus-port``)
cannot be bound (one log line; checked before the worker wait) or a
``--worker-urls`` worker never became healthy within
``--worker-startup-timeout-secs``, 2 on bad flags (argparse, or one line when building the
policy finds a flag bad, e.g. a ``--tokenizer-path`` file that is no tokenizer).
"""

from __future__ import annotations

import asyncio
import errno
import gc
import logging
import signal
import sys

from . import compiled
from .app import Router
from .config import RouterConfig, parse_args
from .http.server import bind_socket, start_server
from .policy_flags import policy_flag_warnings
from .routes import make_routes, metrics_routes

log = logging.getLogger("fleetserve.router")

#: Seconds between the "still waiting for ..." lines while ``--worker-urls`` workers start (a
#: wrong URL or a slow model load is then visible long before --worker-startup-timeout-secs).
STARTUP_LOG_INTERVAL_S = 30.0


async def serve(cfg: RouterConfig, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None) -> int:
    """Run the router until ``stop`` is set (or a signal arrives); returns the exit code."""
    # bind the ports before the (possibly long) wait for the workers, so a busy port fails at once
    socks = _bind_all(cfg)
    if socks is None:
        return 2  # a start-up error, as a bad flag (and as fleetserve serve / launch / sim-worker)
    try:
        router = Router(cfg)
    except ValueError as e:  # a setting only building the policy finds bad (e.g. an unreadable --tokenizer-path)
        for sk in socks:
            sk.close()
        print(f"fleetserve router: error: {e}", file=sys.stderr)
        return 2
    await router.start()
    stop = stop or asyncio.Event()
    force = asyncio.Event()  # a second signal: stop waiting for the requests in flight

    def on_signal() -> None:
        if stop.is_set():
            force.set()
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, on_signal)
        except (NotImplementedError, RuntimeError):  # pragma: no cover - not the main thread
            pass
    servers = []
    try:
        if cfg.worker_urls and not cfg.disable_health_check:
            log.info("waiting up to %g s for %d worker(s) to become healthy: %s", cfg.worker_startup_timeout_secs,
                     len(cfg.worker_urls), " ".join(cfg.worker_urls))
        elif cfg.worker_urls:
            log.info("health checks off: adding %d worker(s) without waiting: %s", len(cfg.worker_urls),
                     " ".join(cfg.worker_urls))
        # a signal must stop the wait too (it can last --worker-startup-timeout-secs, 1800 s by default)
        adding = asyncio.ensure_future(router.add_initial_workers())
        stopping = asyncio.ensure_future(stop.wait())
        started = loop.time()
        while not (await asyncio.wait((adding, stopping), timeout=STARTUP_LOG_INTERVAL_S,
                                      return_when=asyncio.FIRST_COMPLETED))[0]:
            log.info("still waiting for %s to become healthy (%.0f of %g s)", " ".join(router.starting),
                     loop.time() - started, cfg.worker_startup_timeout_secs)
        stopping.cancel()
        if not adding.done():
            adding.cancel()
            await asyncio.gather(adding, return_exceptions=True)
            log.error("stopped while waiting for workers to become healthy")
            return 1
        failed = adding.result()
        if failed:
            log.error("workers not healthy within %s s: %s", cfg.worker_startup_timeout_secs, " ".join(failed))
            return 1
        servers.append(await start_server(make_routes(router), None, None, cfg.max_payload_size, sock=socks[0],
                                          arrivals=router.pool.arrivals))
        if cfg.prometheus_port is not None:
            servers.append(await start_server(metrics_routes(router), None, None, 1024, sock=socks[1]))
        # Everything allocated so far (modules, app, workers) lives as long as the process:
        # move it out of the cyclic GC's generations, so a full collection only walks what
        # the router allocates later (a full pass over the start-up objects took ~30 ms here).
        gc.collect()
        gc.freeze()
        main_addr = _address(servers[0])
        log.info("fleetserve router on http://%s, policy %s, %d workers", main_addr, cfg.policy,
                 len(router.registry))
        if len(servers) > 1:
            log.info("metrics also on http://%s/metrics", _address(servers[1]))
        log.info("%s", compiled.summary())
        slow = compiled.warning()
        if slow:
            log.warning("%s", slow)
        if ready is not None:
            ready.set()
        await stop.wait()
        router.shutting_down = True  # /readiness: 503 from now on
        for srv in servers:
            srv.close()  # stop accepting; open connections keep their requests in flight
        deadline = loop.time() + cfg.shutdown_grace_period_secs
        if router.inflight():
            log.info("shutting down: waiting up to %.0f s (--shutdown-grace-period-secs) for %d requests in "
                     "flight", cfg.shutdown_grace_period_secs, router.inflight())
        while router.inflight() and loop.time() < deadline and not force.is_set():
            await asyncio.sleep(0.05)
        if router.inflight():  # their connections are closed: a client sees a cut answer, never a whole one
            log.warning("shutting down: %s with %d requests still in flight; their connections are closed now",
                        "a second signal came" if force.is_set() else "the grace period is over",
                        router.inflight())
        return 0
    finally:
        for srv in servers:
            srv.close()
        for sk in socks[len(servers):]:  # bound but never served (stopped during the worker wait)
            sk.close()
        await router.stop()


def _bind_all(cfg: RouterConfig) -> list | None:
    """Sockets bound to the main port and the metrics port (if any); None, after one log line, if one cannot be."""
    socks = []
    for flags, host, port in (("--host/--port", cfg.host, cfg.port),
                              ("--prometheus-host/--prometheus-port", cfg.prometheus_host, cfg.prometheus_port)):
        if port is None:
            continue
        try:
            socks.append(bind_socket(host, port))
        except OSError as e:
            why = "address already in use" if e.errno == errno.EADDRINUSE else (e.strerror or str(e))
            log.error("cannot listen on %s:%d (%s): %s", host, port, flags, why)
            for sk in socks:
                sk.close()
            return None
    return socks


def _address(server) -> str:
    """``host:port`` a listener is bound to (the real port when 0 was asked for)."""
    host, port = server.sockets[0].getsockname()[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cfg = parse_args(argv)
    level = {"warn": "WARNING"}.get(cfg.log_level, cfg.log_level.upper())
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for line in policy_flag_warnings(argv, cfg):  # accepted, as sglang-router does, but said (policy_flags.py)
        log.warning("%s", line)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency
        return asyncio.run(serve(cfg))
    return uvloop.run(serve(cfg))


if __name__ == "__main__":
    sys.exit(main())
