"""Tool definitions, assistant tool calls and tool results on their way into a chat template.

A template that knows tools (it mentions ``tool_calls`` / ``tools``, as Qwen 2.5's, Llama 3.1's
or DeepSeek-V3's do) gets the messages as they are, except that each call's
``function.arguments`` JSON text becomes an object, as vLLM passes it (Llama 3.1's template
writes ``arguments | tojson``).

A template that does not (SmolLM2's built-in one renders only ``role`` and ``content``) would
drop them silently, so they are written into the text instead, in the ``<tool_call>`` JSON
format that the forced calls and ``qwen25`` use:

* the tools: a system-prompt section listing each function's JSON definition and saying how
  to call one (appended to the first system message, or a new system message first);
* an assistant message's ``tool_calls``: one ``<tool_call>\\n{"name", "arguments"}\\n</tool_call>``
  block each, after its content;
* a ``tool`` message: its content inside ``<tool_response>`` tags, with its ``tool_call_id``.
"""

from __future__ import annotations

import json
from typing import Any

TOOLS_INTRO = ("You can call functions to help with the user's request. The functions, as JSON "
               "definitions, are:\n<tools>\n{defs}\n</tools>\nTo call one, answer with a JSON object "
               "giving its name and its arguments inside tags, one block per call:\n<tool_call>\n"
               '{{"name": <function name>, "arguments": <arguments object>}}\n</tool_call>')


def _arguments_object(args: Any) -> Any:
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            return args
    return args


def _call_block(call: dict[str, Any]) -> str:
    fn = call.get("function") or {}
    body = {"name": fn.get("name"), "arguments": _arguments_object(fn.get("arguments", {}))}
    return f"<tool_call>\n{json.dumps(body, ensure_ascii=False)}\n</tool_call>"


def template_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                      template: str | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """``(messages, tools)`` to hand to ``apply_chat_template`` for a template text ``template``
    (see the module doc). The input lists are not changed."""
    knows_calls = bool(template) and "tool_calls" in template
    knows_tools = bool(template) and "tools" in template.replace("tool_calls", "")
    out = []
    for m in messages:
        m = dict(m)
        calls = m.get("tool_calls")
        if calls:
            if knows_calls:
                m["tool_calls"] = [{**c, "function": {**(c.get("function") or {}), "arguments": _arguments_object(
                    (c.get("function") or {}).get("arguments", {}))}} for c in calls]
            else:
                blocks = "\n".join(_call_block(c) for c in calls)
                m["content"] = f"{m['content']}\n{blocks}" if m.get("content") else blocks
                del m["tool_calls"]
        if m.get("role") == "tool" and not knows_calls:
            ref = f' id="{m["tool_call_id"]}"' if m.get("tool_call_id") else ""
            m["content"] = f"<tool_response{ref}>\n{m.get('content') or ''}\n</tool_response>"
        out.append(m)
    if tools and not knows_tools:
        intro = TOOLS_INTRO.format(defs="\n".join(json.dumps(t.get("function", t), ensure_ascii=False)
                                                  for t in tools))
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{intro}" if out[0].get("content") else intro}
        else:
            out.insert(0, {"role": "system", "content": intro})
        tools = None
    return out, tools
