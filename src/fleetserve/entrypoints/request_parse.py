"""A JSON body into a pydantic request model, every failure an :class:`APIError` 400 naming the field.

Framework-free (pydantic only), so that the engine's HTTP front (``entrypoints/http/body.py``)
and ``fleetserve sim-worker`` (``bench/sim_worker.py``, on aiohttp) refuse a bad body the same way.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from fleetserve.entrypoints.errors import APIError

ModelT = TypeVar("ModelT", bound=BaseModel)


def _is_branch_label(item: Any) -> bool:
    """A union branch label pydantic puts into an error location (``"str"``, ``"list[int]"``, ``"function-after[...]"``)."""
    if isinstance(item, int):
        return False
    s = str(item)
    return any(ch in s for ch in "[]()") or s in {"str", "int", "float", "bool", "list", "dict", "none"}


def loc_to_param(loc: tuple | list) -> str | None:
    """Turn a pydantic error location into a dotted parameter name.

    ``("body", "messages", 0, "content") -> "messages.0.content"``; union branch
    labels that pydantic inserts (``"list[int]"``, ``"function-after[...]"``) are dropped.
    """
    parts = [str(item) for item in loc if not _is_branch_label(item)]
    if parts and parts[0] == "body":
        parts.pop(0)
    return ".".join(parts) or None


def _union_split(loc: tuple | list) -> tuple[tuple, tuple] | None:
    """``("messages", 0, "content", "str") -> (("messages", 0, "content"), ())``: the location of the
    union and what follows its first branch label; None when the location crosses no union."""
    for i, item in enumerate(loc):
        if _is_branch_label(item):
            return tuple(loc[:i]), tuple(loc[i + 1:])
    return None


def _first_error(errs: list[dict]) -> tuple[str, str | None]:
    """(message, param) for the first pydantic error, unions explained.

    When every branch of a union failed on the value's type, the message lists what
    was expected (``expected a valid list or a valid string``) and ``param`` is the
    union's field, however deep (``messages.0.content``). When a branch took the value
    and failed inside it, that deeper error is the one reported
    (``messages.0.content.0.text``): it is the one the client has to fix. When several
    branches took it (``[1, true]`` as a list of strings and as a list of token ids),
    the union's field and the union's expectations are reported.
    """
    first = errs[0]
    loc = first.get("loc") or ()
    split = _union_split(loc)
    if split is not None:
        where = split[0]
        branches = [(e, _union_split(e.get("loc") or ())) for e in errs]
        branches = [(e, sp[1]) for e, sp in branches if sp is not None and sp[0] == where]
        deeper = [e for e, rest in branches if rest]
        took = {e["loc"][len(where)] for e in deeper}  # the labels of the branches that took the value
        if len(took) == 1:  # one branch took it: its inner error is the one to fix
            first = deeper[0]
        elif len(branches) > 1:
            param = loc_to_param(where)
            wanted = sorted({e["msg"].replace("Input should be ", "") for e, _ in branches})
            return f"invalid value for '{param}': expected {' or '.join(wanted)}", param
    param = loc_to_param(first.get("loc") or ())
    return (f"invalid value for '{param}': {first['msg']}" if param else first["msg"]), param


def parse_model(cls: type[ModelT], data: Any) -> ModelT:
    """Validate ``data`` into ``cls``.

    Raises:
        APIError(400): ``data`` is not a JSON object, or a field is wrong; ``param``
            names the first bad field, as deep as it lies (``messages.0.content``);
            for a union, the message says what was expected.
    """
    if not isinstance(data, dict):
        raise APIError("the request body must be a JSON object", 400)
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        msg, param = _first_error(e.errors(include_url=False))
        raise APIError(msg, 400, param) from None
