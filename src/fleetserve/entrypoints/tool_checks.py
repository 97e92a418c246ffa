"""OpenAI's checks of ``tools`` and ``tool_choice`` on ``/v1/chat/completions``.

The shapes are OpenAI's: a tool is ``{"type": "function", "function": {"name",
"description"?, "parameters"? (a JSON schema object), "strict"?}}``;
``tool_choice`` is ``"none"``, ``"auto"``, ``"required"`` or
``{"type": "function", "function": {"name": ...}}``. These checks refuse what
could never work (a choice that needs a tool when there is none, an unknown
named function, malformed definitions, tool messages without their call id)
with a 400 naming the field, as OpenAI does.
"""

from __future__ import annotations

import re
from typing import Any

from fleetserve.entrypoints.errors import APIError

TOOL_CHOICES = ("none", "auto", "required")
# OpenAI: a function name is a-z, A-Z, 0-9, underscores and dashes, at most 64 characters
FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def check_tools(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None) -> None:
    """Refuse malformed ``tools`` and a ``tool_choice`` they cannot satisfy.

    Raises:
        APIError(400): ``tools.<i>.type`` not ``function``; ``tools.<i>.function`` missing;
            ``tools.<i>.function.name`` missing or not a valid name; ``parameters`` not an
            object; ``tool_choice`` not one of :data:`TOOL_CHOICES` nor a named function;
            ``required`` or a named function with no tools; a named function not in ``tools``.
    """
    names = []
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise APIError(f"tools[{i}].type must be 'function'", 400, f"tools.{i}.type")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise APIError(f"tools[{i}].function must be an object", 400, f"tools.{i}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.match(name):
            raise APIError(f"tools[{i}].function.name must match {FUNCTION_NAME.pattern}, got {name!r}", 400,
                           f"tools.{i}.function.name")
        if "parameters" in fn and not isinstance(fn["parameters"], dict):
            raise APIError(f"tools[{i}].function.parameters must be a JSON schema object", 400,
                           f"tools.{i}.function.parameters")
        names.append(name)
    if tool_choice is None:
        return
    if isinstance(tool_choice, str):
        if tool_choice not in TOOL_CHOICES:
            raise APIError(f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or a named function, got "
                           f"{tool_choice!r}", 400, "tool_choice")
        if tool_choice == "required" and not names:
            raise APIError("tool_choice 'required' needs at least one tool in 'tools'", 400, "tool_choice")
        return
    fn = tool_choice.get("function") if tool_choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise APIError("a named tool_choice is {\"type\": \"function\", \"function\": {\"name\": ...}}", 400,
                       "tool_choice")
    if name not in names:
        raise APIError(f"tool_choice names function {name!r}, which is not in 'tools'", 400, "tool_choice")


def check_tool_messages(messages: list[Any]) -> None:
    """Refuse tool-call messages OpenAI refuses (``messages`` as parsed :class:`ChatMessage` objects).

    Raises:
        APIError(400): a ``tool`` message without ``tool_call_id`` (``messages.<k>.tool_call_id``);
            an assistant ``tool_calls`` entry that is not ``{"id", "type": "function", "function":
            {"name", "arguments" (a string)}}`` (``messages.<k>.tool_calls.<j>...``).
    """
    for k, m in enumerate(messages):
        if m.role == "tool" and not m.tool_call_id:
            raise APIError(f"messages[{k}] has role 'tool' but no tool_call_id", 400, f"messages.{k}.tool_call_id")
        for j, call in enumerate(m.tool_calls or []):
            where = f"messages.{k}.tool_calls.{j}"
            if m.role != "assistant":
                raise APIError(f"messages[{k}]: only assistant messages carry tool_calls", 400, f"messages.{k}.tool_calls")
            if not isinstance(call, dict) or not isinstance(call.get("id"), str):
                raise APIError(f"{where}.id must be a string", 400, f"{where}.id")
            if call.get("type") != "function":
                raise APIError(f"{where}.type must be 'function'", 400, f"{where}.type")
            fn = call.get("function")
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise APIError(f"{where}.function.name must be a string", 400, f"{where}.function.name")
            if not isinstance(fn.get("arguments"), str):
                raise APIError(f"{where}.function.arguments must be a JSON string", 400, f"{where}.function.arguments")
