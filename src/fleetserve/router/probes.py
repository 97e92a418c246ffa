"""Probe endpoints with sglang-router 0.3.2's behaviour (checked by running it).

* ``GET /liveness``: 200 while the process serves (like ``/health``).
* ``GET /health_generate``: 200 ``At least one router has healthy workers``
  when some worker can take a request, else 503 ``No routers with healthy
  workers available`` (plain text, sglang-router's words).  Like
  sglang-router 0.3.2 it asks no worker to generate.
* ``GET /get_loads``: each registered worker's own load, fetched from its
  ``GET /get_load``: ``{"workers": [{"worker": url, "load": n}, ...]}``.
  ``n`` is the sum of ``num_tokens`` over the ranks SGLang's ``/get_load``
  lists (smg's reading), a plain ``{"load": n}`` is taken as it is, and a
  worker that does not answer 2xx with one of those is ``-1``, as in
  sglang-router.  The client's credential headers are passed on.

``/readiness`` is in :mod:`.admin`.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import aiohttp
import orjson

from .auth import for_worker
from .http.server import Request, Response
from .proxy import credential_headers

if TYPE_CHECKING:
    from .app import Router

_TEXT = "text/plain; charset=utf-8"
HEALTH_GENERATE_OK = b"At least one router has healthy workers"
HEALTH_GENERATE_NONE = b"No routers with healthy workers available"


async def handle_liveness(router: Router, request: Request) -> Response:
    return Response(200, b'{"status":"ok"}')


async def handle_health_generate(router: Router, request: Request) -> Response:
    if router.registry.available():
        return Response(200, HEALTH_GENERATE_OK, _TEXT)
    return Response(503, HEALTH_GENERATE_NONE, _TEXT)


def parse_load(data) -> int:
    """A worker's ``/get_load`` body (decoded JSON) -> its load, or -1 if the shape is unknown.

    SGLang answers a list with one object per DP rank, each with
    ``num_tokens``: the load is their sum (as smg reads it).  An object
    ``{"load": n}`` (older SGLang) is ``n``.
    """
    if isinstance(data, list):
        total = 0
        for entry in data:
            v = entry.get("num_tokens") if isinstance(entry, dict) else None
            if isinstance(v, int) and not isinstance(v, bool):
                total += v
        return total
    if isinstance(data, dict):
        v = data.get("load")
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return -1


async def handle_get_loads(router: Router, request: Request) -> Response:
    workers = list(router.registry.workers)
    creds = credential_headers(request)

    async def one(w) -> int:
        try:
            async with router.session.get(w.url + "/get_load", headers=for_worker(w.api_key, creds),
                                          timeout=aiohttp.ClientTimeout(total=router.cfg.health_check_timeout_secs)
                                          ) as r:
                if not 200 <= r.status < 300:
                    return -1
                return parse_load(orjson.loads(await r.read()))
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, orjson.JSONDecodeError):
            return -1

    loads = await asyncio.gather(*(one(w) for w in workers))
    return Response(200, orjson.dumps({"workers": [{"worker": w.url, "load": n} for w, n in zip(workers, loads)]}))
