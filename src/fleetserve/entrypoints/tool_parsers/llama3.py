"""Llama 3's JSON tool calls (``--tool-call-parser llama3``, SGLang's name; vLLM's ``llama3_json``)::

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}

The Llama 3.1 / 3.2 chat templates ask for ``{"name": ..., "parameters": {...}}``; ``arguments``
is read too. The output is a call when it contains ``<|python_tag|>`` (text before it is
content) or begins with ``{`` (a special token that was skipped leaves only the JSON);
several calls are separated by ``;`` (SGLang's separator). An object that is not a call
(no string ``name``) leaves the whole output as content.
"""

from __future__ import annotations

import json
from typing import Any

from fleetserve.entrypoints.tool_parsers.base import Scan
from fleetserve.entrypoints.tool_parsers.json_scan import partial_json_call

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = ";"
_WS = " \t\r\n"


class Llama3Format:
    name = "llama3"
    markers = (PYTHON_TAG,)

    def scan(self, text: str, final: bool) -> Scan:
        tag = text.find(PYTHON_TAG)
        if tag >= 0:
            start, pos = tag, tag + len(PYTHON_TAG)
        else:
            lead = len(text) - len(text.lstrip(_WS))
            if lead == len(text):
                return Scan() if final else Scan(start=0)  # nothing but space yet: wait
            if text[lead] != "{":
                return Scan()
            start = pos = lead
        sc = Scan(start=start)
        while True:
            while pos < len(text) and text[pos] in _WS:
                pos += 1
            if pos >= len(text):
                return sc
            call = partial_json_call(text, pos)
            if call is None or (call.done and not call.valid) or (final and not call.valid):
                if not final and call is None and text[pos] == "{":
                    return sc  # maybe {"name" is still coming
                if not sc.calls and tag < 0:
                    return Scan()  # a JSON answer, not a call
                sc.tail = text[pos:]
                return sc
            sc.calls.append(call)
            if not call.done:
                return sc
            pos = call.end
            while pos < len(text) and text[pos] in _WS:
                pos += 1
            if pos < len(text) and text[pos] == SEPARATOR:
                pos += 1
            elif pos < len(text):
                sc.tail = text[pos:]
                return sc

    def call_grammar(self, variants: list[tuple[str, dict[str, Any]]], parallel: bool) -> str:
        objs = [{"type": "object",
                 "properties": {"name": {"const": name}, "parameters": schema},
                 "required": ["name", "parameters"], "additionalProperties": False} for name, schema in variants]
        schema = objs[0] if len(objs) == 1 else {"anyOf": objs}
        rep = f' ({json.dumps(SEPARATOR + " ")} call)*' if parallel else ""
        return f"start: call{rep}\ncall: %json {json.dumps(schema)}\n"
