"""APIError (and the framework's own errors) as OpenAI-style JSON responses."""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from fleetserve.entrypoints.errors import APIError
from fleetserve.entrypoints.request_parse import loc_to_param

logger = logging.getLogger(__name__)


def error_response(exc: APIError) -> JSONResponse:
    """The JSON body of ``exc`` with ``exc.status`` (a 401 also says ``WWW-Authenticate: Bearer``)."""
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    return JSONResponse(exc.to_dict(), status_code=exc.status, headers=headers)


def status_phrase(status: int) -> str:
    """``404 -> "Not Found"`` (for errors raised by the framework without a message)."""
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return error_response(exc)


async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    msg = exc.detail if isinstance(exc.detail, str) else status_phrase(exc.status_code)
    return error_response(APIError(msg, exc.status_code))


async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    errs = exc.errors()
    param = loc_to_param(errs[0].get("loc", ())) if errs else None
    return error_response(APIError(errs[0]["msg"] if errs else "invalid request", 400, param))


async def _internal(_: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error")
    return error_response(APIError(f"internal error: {type(exc).__name__}: {exc}", 500))


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error with the OpenAI body: APIError as raised, unknown routes and
    methods with their status, FastAPI's own validation with 400, anything else 500."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _internal)
