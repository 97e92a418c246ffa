"""Request bodies read and parsed by hand, so that every bad body gets an OpenAI-style error.

FastAPI's own body parsing answers 422 in its own shape; here malformed JSON
and wrong types are 400 naming the field, and a body over the limit is 413.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from fleetserve.entrypoints.errors import APIError
from fleetserve.entrypoints.http.errors import loc_to_param

ModelT = TypeVar("ModelT", bound=BaseModel)


async def read_json(request: Request, limit: int) -> Any:
    """The request body as JSON.

    Raises:
        APIError: 413 (``request_too_large``) past ``limit`` bytes, by Content-Length or
            as streamed; 400 when empty; 400 (``invalid_json``) when not JSON.
    """
    cl = request.headers.get("content-length")
    if cl is not None and cl.isdigit() and int(cl) > limit:
        raise APIError(f"request body of {cl} bytes is over the limit of {limit} bytes", 413, None, "request_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise APIError(f"request body is over the limit of {limit} bytes", 413, None, "request_too_large")
    if not body:
        raise APIError("request body is empty; send a JSON object", 400)
    try:
        return json.loads(bytes(body))
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(f"malformed JSON body: {e}", 400, None, "invalid_json") from e
    except RecursionError as e:  # arrays or objects nested deeper than the parser's stack
        raise APIError("malformed JSON body: nested too deeply", 400, None, "invalid_json") from e


def parse_model(cls: type[ModelT], data: Any) -> ModelT:
    """Validate ``data`` into ``cls``.

    Raises:
        APIError(400): ``data`` is not a JSON object, or a field is wrong; ``param``
            names the first bad field (for a union, what was expected).
    """
    if not isinstance(data, dict):
        raise APIError("the request body must be a JSON object", 400)
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        errs = e.errors(include_url=False)
        first = errs[0]
        param = loc_to_param(first.get("loc", ()))
        top = first.get("loc", ("",))[0] if first.get("loc") else None
        same = [x for x in errs if x.get("loc") and x["loc"][0] == top]
        if len(same) > 1:  # a union: say what was expected instead of the first branch's complaint
            wanted = sorted({x["msg"].replace("Input should be ", "") for x in same})
            msg = f"invalid value for '{top}': expected {' or '.join(wanted)}"
            param = str(top)
        else:
            msg = f"invalid value for '{param}': {first['msg']}" if param else first["msg"]
        raise APIError(msg, 400, param) from None


async def read_request(request: Request, cls: type[ModelT], limit: int) -> ModelT:
    """:func:`read_json` then :func:`parse_model`."""
    return parse_model(cls, await read_json(request, limit))
