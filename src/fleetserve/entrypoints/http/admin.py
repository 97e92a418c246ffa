"""Probes and operations: health, version, model and server info, cache flush, abort, Prometheus metrics."""

from __future__ import annotations

import asyncio
import logging
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from fleetserve.engine.sampling_params import SamplingParams
from fleetserve.entrypoints.errors import APIError
from fleetserve.entrypoints.http.body import read_request
from fleetserve.entrypoints.http.errors import error_response
from fleetserve.entrypoints.http.state import ServerState, server_state
from fleetserve.entrypoints.http.streaming import submit_all
from fleetserve.entrypoints.metrics import CONTENT_TYPE
from fleetserve.entrypoints.openai_protocol import AbortRequest, ModelCard, ModelList
from fleetserve.entrypoints.server_info import router_discovery_fields
from fleetserve.entrypoints.version import PACKAGE_VERSION

logger = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT_S = 30.0

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> Response:
    if not server_state(request).engine_running():
        return error_response(APIError("the scheduler process is not running", 503, None, "engine_unavailable"))
    return Response(status_code=200)


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    """Generate one token from token id 0; 503 when that takes over 30 s."""
    sp = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    stream = submit_all(server_state(request), [[0]], [sp])[0]

    async def drain() -> None:
        async for _ in stream:
            pass

    try:
        await asyncio.wait_for(drain(), HEALTH_GENERATE_TIMEOUT_S)
    except asyncio.TimeoutError:
        return error_response(APIError("one-token generation did not finish in 30 s", 503, None, "engine_unavailable"))
    finally:
        stream.abort()
    return Response(status_code=200)


def model_card(state: ServerState) -> ModelCard:
    info = state.info
    return ModelCard(id=state.model_name, root=info.model_path, max_model_len=info.context_length,
                     created=int(state.tm.started))


@router.get("/version")
async def version() -> JSONResponse:
    """vLLM's ``GET /version``: ``{"version": "<fleetserve's version>"}``, open without the API key."""
    return JSONResponse({"version": PACKAGE_VERSION})


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    return JSONResponse(ModelList(data=[model_card(server_state(request))]).model_dump())


@router.get("/v1/models/{name:path}")
async def retrieve_model(request: Request, name: str) -> JSONResponse:
    state = server_state(request)
    state.check_model(name)
    return JSONResponse(model_card(state).model_dump())


@router.get("/get_model_info")
async def get_model_info(request: Request) -> JSONResponse:
    state = server_state(request)
    info = state.info
    return JSONResponse({
        "model_path": info.model_path,
        "tokenizer_path": state.server_args.get("tokenizer_path") or info.model_path,
        "served_model_name": state.model_name,
        "is_generation": True,
        "context_length": info.context_length,
        "vocab_size": info.vocab_size,
    })


@router.get("/get_server_info")
async def get_server_info(request: Request) -> JSONResponse:
    state = server_state(request)
    tm, info = state.tm, state.info
    stats = await tm.get_stats()
    totals = tm.metrics.set_stats(stats)
    safe_args = {k: v for k, v in state.server_args.items() if k != "api_key"}
    return JSONResponse({
        **safe_args,
        **router_discovery_fields(state.server_args),
        "served_model_name": state.model_name,
        "context_length": info.context_length,
        "vocab_size": info.vocab_size,
        "uptime_s": time.time() - tm.started,
        "stats": totals,
        "scheduler_stats": [s.__dict__ for s in stats],
        "active_requests": len(tm.streams),
        "version": PACKAGE_VERSION,  # as SGLang's /get_server_info
    })


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request) -> JSONResponse:
    """Empty the radix cache; 409 while requests run (or when a scheduler does not answer)."""
    if not await server_state(request).tm.flush_cache():
        return JSONResponse({"success": False, "message": "not flushed: requests are running (or no answer)"},
                            status_code=409)
    return JSONResponse({"success": True, "message": "radix cache flushed"})


@router.post("/abort_request")
async def abort_request(request: Request) -> JSONResponse:
    """Abort the request ``rid`` and its ``rid-<i>`` samples; ``aborted`` lists those running here."""
    state = server_state(request)
    tm = state.tm
    req = await read_request(request, AbortRequest, state.max_request_bytes)
    rids = [r for r in list(tm.streams) if r == req.rid or r.startswith(req.rid + "-")]
    for r in rids:
        tm.abort_request(r)
    if not rids:
        tm.send_abort(req.rid)
    return JSONResponse({"success": bool(rids), "aborted": rids})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    tm = server_state(request).tm
    try:
        tm.metrics.set_stats(await tm.get_stats(timeout=1.0))
    except Exception:  # stale gauges beat no metrics
        logger.exception("could not refresh scheduler stats")
    return Response(tm.metrics.render(), media_type=CONTENT_TYPE)
