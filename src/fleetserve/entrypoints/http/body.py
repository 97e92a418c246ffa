"""Request bodies read and parsed by hand, so that every bad body gets an OpenAI-style error.

FastAPI's own body parsing answers 422 in its own shape; here malformed JSON
and wrong types are 400 naming the field, and a body over the limit is 413.

Without a ``Content-Type`` the body is read as JSON, as the peers do: FastAPI
parses a typed body (vLLM's) as JSON when no Content-Type is sent, and SGLang's
handlers call ``request.json()`` without reading the header.  Another
Content-Type is not checked either (SGLang's way; FastAPI would refuse it).
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request

from fleetserve.entrypoints.errors import APIError
from fleetserve.entrypoints.request_parse import ModelT, parse_model


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


async def read_request(request: Request, cls: type[ModelT], limit: int) -> ModelT:
    """:func:`read_json` then :func:`parse_model`."""
    return parse_model(cls, await read_json(request, limit))
