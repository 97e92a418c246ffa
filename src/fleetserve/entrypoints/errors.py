"""OpenAI-style JSON errors for the engine's HTTP API.

Every bad request is answered with a 4xx status and the body
``{"error": {"message": str, "type": str, "param": str | None, "code": int | str | None}}``
(the shape the OpenAI API and the ``openai`` Python client expect), and the
server keeps serving.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi.responses import JSONResponse

# OpenAI's error "type" for each status we emit.
_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error to answer with an OpenAI-style JSON body.

    Args:
        message: human-readable explanation.
        status: HTTP status (400 unless said otherwise).
        param: the offending request field, dotted (``"messages.0.content"``), or None.
        code: machine-readable code; defaults to the HTTP status.
        type: OpenAI error type; derived from ``status`` when omitted.
    """

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: int | str | None = None,
        type: str | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.status = int(status)
        self.param = param
        self.code = code if code is not None else self.status
        self.type = type or _TYPE_BY_STATUS.get(self.status, "invalid_request_error")

    def to_dict(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.to_dict(), status_code=self.status, headers=headers)


def error_response(message: str, status: int = 400, param: str | None = None, code: int | str | None = None) -> JSONResponse:
    """Shortcut: build the JSON error response directly."""
    return APIError(message, status, param, code).response()


def status_phrase(status: int) -> str:
    """``404 -> "Not Found"`` (for errors raised by the framework without a message)."""
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


def loc_to_param(loc: tuple | list) -> str | None:
    """Turn a pydantic error location into a dotted parameter name.

    ``("body", "messages", 0, "content") -> "messages.0.content"``; union branch
    labels that pydantic inserts (``"list[int]"``, ``"function-after[...]"``) are dropped.
    """
    parts: list[str] = []
    for item in loc:
        if item == "body" and not parts:
            continue
        if isinstance(item, int):
            parts.append(str(item))
            continue
        s = str(item)
        if any(ch in s for ch in "[]()") or s in {"str", "int", "float", "bool", "list", "dict", "none"}:
            continue
        parts.append(s)
    return ".".join(parts) or None
