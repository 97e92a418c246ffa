"""What a chat request's ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` ask of the server.

The formats themselves (how each model family writes a call, parsed whole and streamed)
are in :mod:`fleetserve.entrypoints.tool_parsers`; this module decides, per request, whether
the output is read as tool calls, in which format, how many calls count, and which grammar
(if any) forces a call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fleetserve.entrypoints.tool_parsers import TOOL_CALL_PARSERS, ToolFormat, get_format, parse_tool_calls

__all__ = ["TOOL_CALL_PARSERS", "ToolPlan", "forced_call_grammar", "parse_tool_calls", "plan_tools"]


def forced_call_grammar(tools: list[dict[str, Any]], name: str | None, parser: str | None = None,
                        parallel: bool = False) -> str:
    """A Lark grammar (llguidance) allowing only tool calls, in the format of ``parser``
    (None: ``qwen25``'s ``<tool_call>`` JSON).

    Args:
        tools: OpenAI tool definitions (already checked).
        name: the one function allowed (a named ``tool_choice``), or None for any of them
            (``tool_choice: "required"``).
        parallel: one or more calls (``parallel_tool_calls`` true); False: exactly one.

    A function without ``parameters`` takes any object.
    """
    variants = [(t["function"]["name"], t["function"].get("parameters") or {"type": "object"})
                for t in tools if name is None or t["function"]["name"] == name]
    return get_format(parser).call_grammar(variants, parallel)


@dataclass
class ToolPlan:
    """How one chat request's output is read.

    Attributes:
        fmt: read the output as tool calls in this format; None: plain text.
        grammar: a grammar forcing calls (``required`` / a named function), else None.
        max_calls: 1 when ``parallel_tool_calls`` is false (later calls are dropped), else None.
    """

    fmt: ToolFormat | None = None
    grammar: str | None = None
    max_calls: int | None = None


def plan_tools(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None,
               parser: str | None, parallel: bool = True) -> ToolPlan:
    """The :class:`ToolPlan` of a checked chat request.

    ``none`` (or no tools): plain text. ``required`` / a named function: a grammar forces a call
    (one, or one or more when ``parallel``) in the format of ``--tool-call-parser`` (``qwen25``
    without one), parsed whatever the flag says. ``auto`` (the default with tools): free text,
    parsed into calls when the server has a parser.
    """
    max_calls = None if parallel else 1
    if not tools or tool_choice == "none":
        return ToolPlan()
    if tool_choice == "required" or isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None
        return ToolPlan(get_format(parser), forced_call_grammar(tools, name, parser, parallel), max_calls)
    return ToolPlan(get_format(parser) if parser else None, None, max_calls)
