"""DeepSeek-V3's tool calls: special markers around a name line and a fenced JSON block::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

(one ``<｜tool▁call▁begin｜>...<｜tool▁call▁end｜>`` per call, as laid out by DeepSeek-V3's chat
template and read by SGLang's ``deepseekv3`` detector and vLLM's ``deepseek_v3`` parser).
``--tool-call-parser deepseekv3`` (SGLang's name; ``deepseek_v3``, vLLM's, means the same).
A lone ``<｜tool▁call▁begin｜>`` without the section marker also opens the section, as in SGLang.
Text after ``<｜tool▁calls▁end｜>`` is content.
"""

from __future__ import annotations

import json
import re
from typing import Any

from fleetserve.entrypoints.tool_parsers.base import Scan
from fleetserve.entrypoints.tool_parsers.json_scan import PartialCall, is_object, value_end

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
FENCE_OPEN, FENCE_CLOSE = "```json\n", "\n```"
_CLOSE = re.compile(r"\s*```\s*" + re.escape(CALL_END))


def _could_become(rest: str, *whole: str) -> bool:
    return any(w.startswith(rest) for w in whole)


class DeepSeekV3Format:
    name = "deepseekv3"
    markers = (CALLS_BEGIN, CALL_BEGIN)

    def scan(self, text: str, final: bool) -> Scan:
        found = [(i, m) for m in self.markers if (i := text.find(m)) >= 0]
        if not found:
            return Scan()
        start, marker = min(found)
        sc = Scan(start=start)
        pos = start + (len(CALLS_BEGIN) if marker == CALLS_BEGIN else 0)
        while True:
            while pos < len(text) and text[pos] in " \t\r\n":
                pos += 1
            rest = text[pos:]
            if rest.startswith(CALLS_END):
                sc.tail = text[pos + len(CALLS_END):]
                return sc
            if not rest.startswith(CALL_BEGIN):
                if not final and _could_become(rest, CALL_BEGIN, CALLS_END):
                    return sc
                sc.tail = rest if sc.calls else text[start:]
                return sc
            call, end = self._call(text, pos, final)
            if call is None:  # malformed, or cut short at the end: content as written
                if final or end >= 0:
                    sc.tail = text[pos:] if sc.calls else text[start:]
                return sc
            sc.calls.append(call)
            if not call.valid:
                return sc  # still being written
            pos = end

    def _call(self, text: str, pos: int, final: bool) -> tuple[PartialCall | None, int]:
        """The call at ``text[pos:]`` (which starts with CALL_BEGIN) and the index past it."""
        sep = text.find(SEP, pos)
        if sep < 0:
            return None, (-1 if not final else 0)
        nl = text.find("\n", sep + len(SEP))
        if nl < 0:
            return None, (-1 if not final else 0)
        name = text[sep + len(SEP):nl].strip()
        a = nl + 1
        if not text.startswith(FENCE_OPEN, a):
            if not final and FENCE_OPEN.startswith(text[a:]):
                return PartialCall(name=name), -1
            return None, 0
        a += len(FENCE_OPEN)
        if a >= len(text):
            return (PartialCall(name=name), -1) if not final else (None, 0)
        if text[a] != "{":
            return None, 0
        vend = value_end(text, a)
        if vend is None:
            return (PartialCall(name=name, arguments=text[a:]), -1) if not final else (None, 0)
        args = text[a:vend]
        m = _CLOSE.match(text, vend)
        if m is not None and is_object(args):
            return PartialCall(name=name, arguments=args, done=True, valid=True, end=m.end()), m.end()
        after = text[vend:]
        if not final and (FENCE_CLOSE + CALL_END).startswith(after.replace(" ", "")):
            return PartialCall(name=name, arguments=args, done=True), -1
        if final and is_object(args) and (FENCE_CLOSE + CALL_END).startswith(after.rstrip()):
            return PartialCall(name=name, arguments=args, done=True, valid=True, end=len(text)), len(text)
        return None, 0

    def call_grammar(self, variants: list[tuple[str, dict[str, Any]]], parallel: bool) -> str:
        rules = []
        for k, (name, schema) in enumerate(variants):
            head = f"{CALL_BEGIN}function{SEP}{name}\n{FENCE_OPEN}"
            rules.append(f"c{k}: {json.dumps(head)} %json {json.dumps(schema)} "
                         f"{json.dumps(FENCE_CLOSE + CALL_END)}")
        alts = " | ".join(f"c{k}" for k in range(len(variants)))
        rep = "+" if parallel else ""
        return (f"start: {json.dumps(CALLS_BEGIN)} (call){rep} {json.dumps(CALLS_END)}\n"
                f"call: {alts}\n" + "\n".join(rules) + "\n")
