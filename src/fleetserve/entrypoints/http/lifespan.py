"""The app's start and stop: the tokenizer manager's receive loop and the scheduler watchdog."""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, Callable

from fastapi import FastAPI

from fleetserve.entrypoints.http.state import server_state_of
from fleetserve.entrypoints.tokenizer_manager import TokenizerManager

# The abort message of requests ended because their scheduler process died.
ENGINE_DIED = "the scheduler process exited"
WATCH_INTERVAL_S = 1.0


async def watch_schedulers(tm: TokenizerManager, is_alive: Callable[[], bool]) -> None:
    """If a scheduler process dies, end the requests waiting on it instead of hanging."""
    while True:
        await asyncio.sleep(WATCH_INTERVAL_S)
        if not is_alive():
            tm.fail_all(ENGINE_DIED)


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Start the receive loop on the server's event loop, and the watchdog when ``is_alive`` is known."""
    state = server_state_of(app)
    state.tm.start()
    watchdog = None
    if state.is_alive is not None:
        watchdog = asyncio.get_running_loop().create_task(watch_schedulers(state.tm, state.is_alive))
    yield
    if watchdog is not None:
        watchdog.cancel()
