"""Worker health: the start-up wait and the periodic active checks.

A check is ``GET <worker><--health-check-endpoint>`` answered 2xx within
``--health-check-timeout-secs``.  A healthy worker becomes unhealthy after
``--health-failure-threshold`` failed checks in a row, and an unhealthy one
healthy again after ``--health-success-threshold`` good checks in a row.
Checks never touch a worker's load.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

from .auth import own_headers
from .workers import Worker

log = logging.getLogger("fleetserve.router")


async def probe(session: aiohttp.ClientSession, url: str, endpoint: str, timeout_s: float,
                worker_key: str | None = None, via: str | None = None) -> bool:
    """True if ``url + endpoint`` answers 2xx within ``timeout_s`` seconds (``worker_key``: the
    worker's own key, sent instead of the session's ``--api-key``, auth.py; ``via``: this router's
    ``Via`` entry, so that a router checking itself gets 508, :mod:`.via`)."""
    return (await _status(session, url + endpoint, timeout_s, worker_key, via)) in range(200, 300)


async def _status(session: aiohttp.ClientSession, url: str, timeout_s: float, worker_key: str | None,
                  via: str | None) -> int | None:
    headers = own_headers(worker_key)
    if via is not None:
        headers = {**headers, "Via": via}
    try:
        async with session.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            await resp.read()
            return resp.status
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return None


async def points_back(session: aiohttp.ClientSession, url: str, via: str, timeout_s: float,
                      worker_key: str | None = None) -> bool:
    """Whether ``url`` is this very router (its ``/health`` answers 508 to a request carrying this
    router's ``Via`` entry ``via``): registered as its own worker, every request would loop."""
    return await _status(session, url + "/health", timeout_s, worker_key, via) == 508


async def wait_healthy(session: aiohttp.ClientSession, url: str, endpoint: str, timeout_s: float,
                       interval_s: float, probe_timeout_s: float, worker_key: str | None = None) -> bool:
    """Poll ``url`` until it is healthy (True) or ``timeout_s`` seconds passed (False)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if await probe(session, url, endpoint, max(0.05, min(probe_timeout_s, left)), worker_key):
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        await asyncio.sleep(min(interval_s, left))


def record_check(worker: Worker, ok: bool, failure_threshold: int, success_threshold: int) -> bool | None:
    """Apply one check result; return the new ``healthy`` value if it changed, else None.

    A worker that becomes healthy again also starts its failed attempts in a row from zero: those
    were what it did before it went down (``/list_workers`` and ``/workers`` would otherwise show
    it ``not_ready`` after its recovery until a request to it succeeded, which on an idle fleet,
    or one whose sessions stick elsewhere, may be never)."""
    if ok:
        worker.health_failures = 0
        worker.health_successes += 1
        if not worker.healthy and worker.health_successes >= success_threshold:
            worker.healthy = True
            worker.failed_in_row = 0
            return True
    else:
        worker.health_successes = 0
        worker.health_failures += 1
        if worker.healthy and worker.health_failures >= failure_threshold:
            worker.healthy = False
            return False
    return None


async def check_all(session: aiohttp.ClientSession, workers: list[Worker], endpoint: str, timeout_s: float,
                    failure_threshold: int, success_threshold: int, via: str | None = None) -> None:
    """One round of checks over ``workers``, concurrently (``via``: as for :func:`probe`)."""
    results = await asyncio.gather(*(probe(session, w.url, endpoint, timeout_s, w.api_key, via) for w in workers))
    for w, ok in zip(workers, results):
        changed = record_check(w, ok, failure_threshold, success_threshold)
        if changed is not None:
            log.warning("worker %s is now %s", w.url, "healthy" if changed else "UNHEALTHY")
