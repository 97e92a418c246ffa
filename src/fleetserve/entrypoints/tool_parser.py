"""Tool calls from the model's text, and the grammar that forces one.

One format so far, JSON in tags, as Qwen 2.5 / Hermes-style chat templates ask the
model to write it::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

``--tool-call-parser`` names it ``qwen25`` (SGLang's name), ``qwen`` or ``hermes``
(vLLM's). Each block becomes an OpenAI tool call ``{"id": "call_<24 hex>", "type":
"function", "function": {"name", "arguments"}}`` with ``arguments`` as a JSON string; a
block whose JSON does not parse, or has no string ``name``, stays in the text.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

TOOL_CALL_PARSERS = ("qwen25", "qwen", "hermes")
START, END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(START) + r"(.*?)(?:" + re.escape(END) + r"|$)", re.S)


def _call(obj: Any) -> dict[str, Any] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Split ``text`` into its content (None when nothing but calls) and its tool calls, in order.

    An unterminated last block (the output was cut short) is parsed if its JSON is complete.
    """
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    pos = 0
    for m in _BLOCK.finditer(text):
        try:
            call = _call(json.loads(m.group(1).strip()))
        except ValueError:
            call = None
        if call is None:
            continue
        kept.append(text[pos:m.start()])
        pos = m.end()
        calls.append(call)
    kept.append(text[pos:])
    content = "".join(kept)
    if calls:
        content = content.strip()
    return (content or None), calls


class ToolCallStream:
    """Streaming side of :func:`parse_tool_calls` for one choice.

    :meth:`feed` returns the content that can be sent now: text before a tool call,
    holding back a tail that may be the start of ``<tool_call>``. From the first tag on,
    text is buffered; :meth:`finish` parses it and returns the remaining content and the
    calls (sent whole, one delta per call, at the end of the choice).
    """

    def __init__(self) -> None:
        self.pending = ""
        self.in_call = False
        self.sent_content = False

    def feed(self, delta: str) -> str:
        self.pending += delta
        if self.in_call:
            return ""
        i = self.pending.find(START)
        if i >= 0:
            out, self.pending, self.in_call = self.pending[:i], self.pending[i:], True
            return self._sent(out)
        hold = 0
        for k in range(min(len(START) - 1, len(self.pending)), 0, -1):
            if START.startswith(self.pending[-k:]):
                hold = k
                break
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(out):]
        return self._sent(out)

    def _sent(self, out: str) -> str:
        self.sent_content = self.sent_content or bool(out)
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        content, calls = parse_tool_calls(self.pending)
        self.pending = ""
        if calls and content and not self.sent_content:
            content = content.strip()
        return content or "", calls


def forced_call_grammar(tools: list[dict[str, Any]], name: str | None) -> str:
    """A Lark grammar (llguidance, ``%json`` for the JSON part) allowing exactly one tool call.

    Args:
        tools: OpenAI tool definitions (already checked).
        name: the one function allowed (a named ``tool_choice``), or None for any of them
            (``tool_choice: "required"``).

    The call is ``<tool_call>\\n{"name": <one of the names>, "arguments": <that function's
    parameters schema>}\\n</tool_call>`` (a function without ``parameters`` takes any object).
    """
    variants = []
    for t in tools:
        fn = t["function"]
        if name is not None and fn["name"] != name:
            continue
        variants.append({"type": "object",
                         "properties": {"name": {"const": fn["name"]},
                                        "arguments": fn.get("parameters") or {"type": "object"}},
                         "required": ["name", "arguments"], "additionalProperties": False})
    schema = variants[0] if len(variants) == 1 else {"anyOf": variants}
    return (f"start: {json.dumps(START + chr(10))} call {json.dumps(chr(10) + END)}\n"
            f"call: %json {json.dumps(schema)}\n")


def plan_tools(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None,
               parser: str | None) -> tuple[bool, str | None]:
    """``(parse the output into tool calls, forcing grammar or None)`` for a checked chat request.

    ``none`` (or no tools): plain text. ``required`` / a named function: a grammar forces
    one call, which is parsed whatever ``--tool-call-parser`` says. ``auto`` (the default
    with tools): free text, parsed into calls when the server has a parser.
    """
    if not tools or tool_choice == "none":
        return False, None
    if tool_choice == "required":
        return True, forced_call_grammar(tools, None)
    if isinstance(tool_choice, dict):
        return True, forced_call_grammar(tools, tool_choice["function"]["name"])
    return parser is not None, None
