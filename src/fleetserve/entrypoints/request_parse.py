"""A JSON body into a pydantic request model, every failure an :class:`APIError` 400 naming the field.

Framework-free (pydantic only), so that the engine's HTTP front (``entrypoints/http/body.py``)
and ``fleetserve sim-worker`` (``bench/sim_worker.py``, on aiohttp) refuse a bad body the same way.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from fleetserve.entrypoints.errors import APIError

ModelT = TypeVar("ModelT", bound=BaseModel)


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
