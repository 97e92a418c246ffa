"""Load probes for routers: SGLang's ``GET /v1/loads`` and its older ``GET /get_load``.

Each call asks every scheduler for fresh stats (one round trip over ZMQ; a
scheduler answers between two steps) and shapes them with
:mod:`fleetserve.entrypoints.load_view`.

``/v1/loads`` query parameters (SGLang's): ``dp_rank`` (one rank only; 400
outside ``[0, dp_size)``), ``include`` (comma-separated sections; 400 for an
unknown one; only ``core`` has figures here) and ``format`` (``json``, the
default, or ``prometheus``).
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from fleetserve.entrypoints.errors import APIError
from fleetserve.entrypoints.http.state import ServerState, server_state
from fleetserve.entrypoints.load_view import (
    LoadsQueryError, legacy_load, loads_body, loads_prometheus, parse_loads_query, select_ranks,
)
from fleetserve.entrypoints.metrics import CONTENT_TYPE

STATS_TIMEOUT_S = 2.0

router = APIRouter()


def accelerators_per_rank(state: ServerState) -> int:
    """Devices behind one DP rank: ``tp_size`` (divided by ``dp_size`` under DP attention), as SGLang counts."""
    args = state.server_args
    tp = int(args.get("tp_size") or 1)
    return max(1, tp // state.dp_size) if args.get("enable_dp_attention") else tp


@router.get("/v1/loads")
async def get_loads(request: Request) -> Response:
    state = server_state(request)
    try:
        fmt, dp_rank = parse_loads_query(request.query_params)
    except LoadsQueryError as e:
        raise APIError(str(e), 400, e.param) from None
    stats = await state.tm.get_stats(timeout=STATS_TIMEOUT_S)
    try:
        stats = select_ranks(stats, state.dp_size, dp_rank)
    except ValueError as e:
        raise APIError(str(e), 400, "dp_rank") from None
    if fmt == "prometheus":
        return Response(loads_prometheus(stats), media_type=CONTENT_TYPE)
    return JSONResponse(loads_body(stats, accelerators_per_rank(state)))


@router.get("/get_load")
async def get_load(request: Request) -> JSONResponse:
    state = server_state(request)
    stats = await state.tm.get_stats(timeout=STATS_TIMEOUT_S)
    return JSONResponse(legacy_load(stats, time.perf_counter()))
