"""In-process helpers for the router's unit tests: an aiohttp app on a free port, a router in the same loop."""

from contextlib import asynccontextmanager

import pytest
from aiohttp import web

from fleetserve.router.app import Router
from fleetserve.router.config import RouterConfig
from fleetserve.router.http.server import start_server
from fleetserve.router.routes import make_routes


async def start_app(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


@asynccontextmanager
async def recording_worker(make_app):
    """A worker app ``make_app(seen)`` on a free port: yields ``(url, seen)``, ``seen`` the list the app
    records its requests in; the app is stopped on exit."""
    seen: list = []
    runner, url = await start_app(make_app(seen))
    try:
        yield url, seen
    finally:
        await runner.cleanup()


class InProcessRouter:
    """A :class:`Router` and its main listener on 127.0.0.1, port chosen by the OS."""

    def __init__(self, **cfg) -> None:
        cfg.setdefault("worker_startup_check_interval", 0.05)
        self.router = Router(RouterConfig(**cfg))

    async def __aenter__(self) -> "InProcessRouter":
        await self.router.start()
        assert await self.router.add_initial_workers() == []
        self.srv = await start_server(make_routes(self.router), "127.0.0.1", 0, 1 << 20,
                                      arrivals=self.router.pool.arrivals)
        self.url = f"http://127.0.0.1:{self.srv.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc) -> None:
        self.srv.close()
        await self.router.stop()



@pytest.fixture(name="start_app")
def _start_app():
    return start_app


@pytest.fixture(name="recording_worker")
def _recording_worker():
    return recording_worker


@pytest.fixture(name="InProcessRouter")
def _in_process_router():
    return InProcessRouter
