"""``fleetserve router``: parse flags, wait for the workers, serve until SIGINT/SIGTERM.

Exit codes: 0 after a clean stop, 1 if a ``--worker-urls`` worker never became
healthy within ``--worker-startup-timeout-secs``, 2 on bad flags (argparse).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from aiohttp import web

from .app import Router
from .config import RouterConfig, parse_args

log = logging.getLogger("fleetserve.router")


async def serve(cfg: RouterConfig, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None) -> int:
    """Run the router until ``stop`` is set (or a signal arrives); returns the exit code."""
    router = Router(cfg)
    await router.start()
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # pragma: no cover - not the main thread
            pass
    runners: list[web.AppRunner] = []
    try:
        failed = await router.add_initial_workers()
        if failed:
            log.error("workers not healthy within %s s: %s", cfg.worker_startup_timeout_secs, " ".join(failed))
            return 1
        # handler_cancellation: a client that goes away cancels its handler, so the
        # upstream request is dropped too (the worker sees the disconnect) and the
        # load is released at once by the finally in Router._attempt.
        runner = web.AppRunner(router.make_app(), access_log=None, handle_signals=False,
                               handler_cancellation=True)
        await runner.setup()
        runners.append(runner)
        await web.TCPSite(runner, cfg.host, cfg.port, backlog=1024).start()
        if cfg.prometheus_port:
            mapp = web.Application()
            mapp.router.add_get("/metrics", router.handle_metrics)
            mrunner = web.AppRunner(mapp, access_log=None, handle_signals=False)
            await mrunner.setup()
            runners.append(mrunner)
            await web.TCPSite(mrunner, cfg.prometheus_host, cfg.prometheus_port).start()
        log.info("fleetserve router on http://%s:%d, policy %s, %d workers", cfg.host, cfg.port, cfg.policy,
                 len(router.registry))
        if ready is not None:
            ready.set()
        await stop.wait()
        return 0
    finally:
        for r in reversed(runners):
            await r.cleanup()
        await router.stop()


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(list(sys.argv[1:] if argv is None else argv))
    level = {"warn": "WARNING"}.get(cfg.log_level, cfg.log_level.upper())
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency
        return asyncio.run(serve(cfg))
    return uvloop.run(serve(cfg))


if __name__ == "__main__":
    sys.exit(main())
