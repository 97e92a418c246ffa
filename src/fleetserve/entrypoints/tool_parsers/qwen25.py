"""JSON in ``<tool_call>`` tags, as Qwen 2.5 / Hermes-style chat templates ask for it::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Several calls are several blocks. ``--tool-call-parser qwen25`` (SGLang's name; vLLM's
``hermes`` and ``qwen`` mean the same). A block whose JSON does not parse, or has no string
``name``, stays in the content; an unterminated last block (output cut short) counts when its
JSON is complete.
"""

from __future__ import annotations

import json
from typing import Any

from fleetserve.entrypoints.tool_parsers.base import Scan
from fleetserve.entrypoints.tool_parsers.json_scan import partial_json_call

START, END = "<tool_call>", "</tool_call>"


class Qwen25Format:
    name = "qwen25"
    markers = (START,)

    def scan(self, text: str, final: bool) -> Scan:
        sc = Scan()
        pos = 0
        tail: list[str] = []
        while True:
            i = text.find(START, pos)
            if i < 0:
                if sc.start >= 0:
                    tail.append(text[pos:])
                break
            if sc.start < 0:
                sc.start = i
            else:
                tail.append(text[pos:i])
            body_at = i + len(START)
            j = text.find(END, body_at)
            body_end = j if j >= 0 else len(text)
            call = partial_json_call(text[:body_end], body_at)
            ok = call is not None and call.valid and not text[call.end:body_end].strip()
            if j < 0 and not final:  # the last block, still being written
                if call is not None:
                    sc.calls.append(call)
                break
            if ok:
                sc.calls.append(call)
            else:  # malformed: the block stays in the content as written
                tail.append(text[i:j + len(END) if j >= 0 else len(text)])
            if j < 0:
                break
            pos = j + len(END)
        sc.tail = "".join(tail)
        return sc

    def call_grammar(self, variants: list[tuple[str, dict[str, Any]]], parallel: bool) -> str:
        objs = [{"type": "object",
                 "properties": {"name": {"const": name}, "arguments": schema},
                 "required": ["name", "arguments"], "additionalProperties": False} for name, schema in variants]
        schema = objs[0] if len(objs) == 1 else {"anyOf": objs}
        rep = ' ("\\n" call)*' if parallel else ""
        return (f"start: call{rep}\n"
                f"call: {json.dumps(START + chr(10))} body {json.dumps(chr(10) + END)}\n"
                f"body: %json {json.dumps(schema)}\n")
