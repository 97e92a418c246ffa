"""Reading JSON that is still being written: where a value ends, and the ``{"name": ..., "arguments": ...}``
head of a tool call before its arguments are complete.

Used by the tool-call formats to stream a call's arguments as the model writes them: the
characters of an object value are part of it from its ``{`` to its matching ``}``, so every
character read so far can be sent at once.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_WS = " \t\r\n"
# the call object's head: {"name": "<name>", "arguments" | "parameters": <value starts here>
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*', re.S)
_NAME_ONLY = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"', re.S)


def value_end(text: str, start: int = 0) -> int | None:
    """Index just past the JSON object or array that begins at ``text[start]``; None while unclosed.

    Raises ValueError when ``text[start]`` is not ``{`` or ``[``. Strings (with escapes) are
    skipped, so braces inside them do not count.
    """
    if start >= len(text) or text[start] not in "{[":
        raise ValueError("not an object or array")
    depth, in_str, esc = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


@dataclass
class PartialCall:
    """One tool call as far as it has been written.

    Attributes:
        name: the function name, once its string is complete (else None).
        arguments: the raw argument text written so far (a prefix of the final JSON object text).
        done: the arguments object and the call around them are closed (or the text after them
            shows the call is malformed).
        valid: done, the arguments parse as a JSON object and the call's own syntax closed.
        end: index (in the text given) just past the call; only meaningful when done.
    """

    name: str | None
    arguments: str = ""
    done: bool = False
    valid: bool = False
    end: int = 0


def _unescape(s: str) -> str | None:
    try:
        return json.loads(f'"{s}"')
    except ValueError:
        return None


def is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def partial_json_call(text: str, start: int = 0) -> PartialCall | None:
    """The call object ``{"name": N, "arguments" (or "parameters"): {...}}`` starting at ``text[start]``.

    Returns None when the text so far cannot be such an object (no ``{"name": "...`` head, or a
    head whose name is not a string). ``end`` is just past the object's closing ``}`` when done.
    A complete object with its keys in another order is read whole (``arguments`` re-serialised).
    """
    head = _HEAD.match(text, start)
    if head is None:
        whole = _whole_object(text, start)
        if whole is not None:
            return whole
        only = _NAME_ONLY.match(text, start)
        if only is None:
            return None
        name = _unescape(only.group(1))
        return None if name is None else PartialCall(name=name)
    name = _unescape(head.group(1))
    if name is None:
        return None
    vstart = head.end()
    if vstart >= len(text):
        return PartialCall(name=name)
    if text[vstart] != "{":
        return _whole_object(text, start)
    vend = value_end(text, vstart)
    if vend is None:
        return PartialCall(name=name, arguments=text[vstart:])
    args = text[vstart:vend]
    k = vend
    while k < len(text) and text[k] in _WS:
        k += 1
    if k >= len(text):  # the arguments are complete, the call's own "}" is still to come
        return PartialCall(name=name, arguments=args)
    closed = text[k] == "}"
    return PartialCall(name=name, arguments=args, done=True, valid=closed and is_object(args),
                       end=k + 1 if closed else vend)


def _whole_object(text: str, start: int) -> PartialCall | None:
    k = start
    while k < len(text) and text[k] in _WS:
        k += 1
    if k >= len(text) or text[k] != "{":
        return None
    end = value_end(text, k)
    if end is None:
        return None
    try:
        obj = json.loads(text[k:end])
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str) and is_object(args):  # some models write the arguments as a JSON string
        args = json.loads(args)
    if not isinstance(args, dict):
        return None
    return PartialCall(name=obj["name"], arguments=json.dumps(args, ensure_ascii=False), done=True, valid=True,
                       end=end)
