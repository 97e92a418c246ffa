"""What every tool-call format provides, and the two ways of reading a model's output with one.

A format (:class:`ToolFormat`) reads the whole output so far and says where its tool-call
section starts, which calls it holds (each as far as written, :class:`PartialCall`) and what
text after the section start is plain content. On top of that one method:

* :func:`parse_tool_calls` reads a finished output: ``(content or None, tool_calls)`` with
  OpenAI's call shape ``{"id": "call_<24 hex>", "type": "function", "function": {"name",
  "arguments"}}``, ``arguments`` the JSON text the model wrote.
* :class:`ToolCallStream` reads it piece by piece and yields OpenAI's streamed deltas: content
  before the section at once (holding back a tail that may begin the section's marker), then
  per call a first delta ``{"index", "id", "type": "function", "function": {"name", "arguments":
  ""}}`` and argument pieces ``{"index", "function": {"arguments": piece}}`` as they are written.
  Their concatenation is the non-streamed ``arguments``.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from fleetserve.entrypoints.tool_parsers.json_scan import PartialCall


@dataclass
class Scan:
    """A format's reading of an output so far.

    Attributes:
        start: index where the tool-call section starts, or -1 (no call yet).
        calls: the calls in order, the last possibly unfinished.
        tail: content after ``start`` that is not a call (text after the section; on the final
            read also every call that turned out malformed, as written).
    """

    start: int = -1
    calls: list[PartialCall] = field(default_factory=list)
    tail: str = ""


class ToolFormat(Protocol):
    """One model family's way of writing tool calls (see the modules of this package)."""

    name: str
    markers: tuple[str, ...]  # texts that open the tool-call section (held back while incomplete)

    def scan(self, text: str, final: bool) -> Scan:
        """Read ``text`` (the whole output so far); ``final``: nothing more will come."""
        ...

    def call_grammar(self, variants: list[tuple[str, dict[str, Any]]], parallel: bool) -> str:
        """A Lark grammar (llguidance) allowing only calls in this format: one (``parallel``
        False) or one or more, each to a function ``name`` with arguments valid under its
        ``schema``, from ``variants`` = ``[(name, schema), ...]``."""
        ...


def new_call_id() -> str:
    """OpenAI's call id shape: ``call_`` and 24 hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


def openai_call(name: str, arguments: str, call_id: str | None = None) -> dict[str, Any]:
    return {"id": call_id or new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def parse_tool_calls(fmt: ToolFormat, text: str, max_calls: int | None = None
                     ) -> tuple[str | None, list[dict[str, Any]]]:
    """Split a finished output into its content (None when nothing but calls) and its calls, in order.

    ``max_calls`` (1 for ``parallel_tool_calls: false``) keeps only the first calls. A call whose
    arguments are not a complete JSON object stays in the content, as written.
    """
    sc = fmt.scan(text, final=True)
    calls = [openai_call(c.name, c.arguments) for c in sc.calls if c.valid and c.name is not None]
    if max_calls is not None:
        calls = calls[:max_calls]
    content = text if sc.start < 0 else text[:sc.start] + sc.tail
    if calls:
        content = content.strip()
    return (content or None), calls


def hold_back(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of ``text`` may be the start of one of ``markers``."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if m.startswith(text[-k:]):
                best = k
                break
    return best


class ToolCallStream:
    """The streaming reader of one choice (see the module doc).

    :meth:`feed` takes the next piece of text and returns ``(content, tool call deltas)`` to
    send now; :meth:`finish` returns what is left when the choice ends. :attr:`calls_sent`
    tells whether any call went out (then the finish reason is ``tool_calls``).
    """

    def __init__(self, fmt: ToolFormat, max_calls: int | None = None) -> None:
        self.fmt = fmt
        self.max_calls = max_calls
        self.text = ""
        self.content_sent = 0    # characters of text[:start] already sent as content
        self.ids: list[str] = []  # call id per call whose head went out
        self.args_sent: list[int] = []
        self.sent_content = False

    @property
    def calls_sent(self) -> int:
        return len(self.ids)

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        self.text += delta
        return self._advance(self.fmt.scan(self.text, final=False), final=False)

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        return self._advance(self.fmt.scan(self.text, final=True), final=True)

    def _advance(self, sc: Scan, final: bool) -> tuple[str, list[dict[str, Any]]]:
        text = self.text
        if sc.start < 0:
            upto = len(text) if final else len(text) - hold_back(text, self.fmt.markers)
            out = text[self.content_sent:upto]
            self.content_sent = max(self.content_sent, upto)
            self.sent_content = self.sent_content or bool(out)
            return out, []
        out = text[self.content_sent:sc.start]
        self.content_sent = sc.start
        self.sent_content = self.sent_content or bool(out)
        deltas: list[dict[str, Any]] = []
        for k, c in enumerate(sc.calls):
            if c.name is None or (self.max_calls is not None and k >= self.max_calls):
                break
            if final and not c.valid and k >= len(self.ids):
                break
            if k >= len(self.ids):
                self.ids.append(new_call_id())
                self.args_sent.append(0)
                deltas.append({"index": k, "id": self.ids[k], "type": "function",
                               "function": {"name": c.name, "arguments": ""}})
            piece = c.arguments[self.args_sent[k]:]
            if piece:
                self.args_sent[k] = len(c.arguments)
                deltas.append({"index": k, "function": {"arguments": piece}})
            if not c.done:
                break
        if final:
            rest = sc.tail
            if self.ids and not self.sent_content:
                rest = rest.strip()
            elif self.ids:
                rest = rest.rstrip()
            out += rest
        return out, deltas
