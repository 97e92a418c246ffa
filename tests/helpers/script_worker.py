"""A fake LLM worker that streams a scripted answer, continues it from any prefix, and dies on command.

For the router's request-migration tests.  A raw asyncio server (``httptools``; answers
written byte for byte, one SSE event per chunk, one token per event) for ``/generate``,
``/v1/completions`` and ``/v1/chat/completions``, in the shapes SGLang and vLLM stream.

The answer is ``script`` (a list of token strings; token ``j`` has id ``ID0 + j``).  A request
says how much of it was produced already, the way a router's continuation does:

* ``/generate``: ``text`` = ``PROMPT`` + the first ``j`` tokens' text, or ``input_ids`` =
  ``PROMPT_IDS`` + ids ``ID0 .. ID0+j-1``;
* ``/v1/completions``: ``prompt`` = ``PROMPT`` + that text;
* chat: a last ``assistant`` message holding that text with ``continue_final_message: true``
  and ``add_generation_prompt: false`` (anything else is answered from the start).

A prefix that is not the script's first ``j`` tokens exactly is answered 400, so a router that
loses or repeats text fails the test.  The worker then streams tokens ``j ..`` up to the
request's token limit (``max_tokens`` / ``max_completion_tokens`` /
``sampling_params.max_new_tokens``), each chunk with this worker's own ids, then a finish
reason (``stop`` at the script's end, else ``length``), usage when asked
(``stream_options.include_usage``; ``prompt_tokens`` = ``PROMPT_TOKENS`` + ``j``), ``[DONE]``.
``tokens_per_chunk`` k > 1 streams OpenAI answers k tokens per event (as an engine with
``--stream-interval k``); with ``continuous_usage_stats`` (vLLM's, with ``include_usage``) every
chunk that carries choices has the usage so far, unless ``honors_continuous_usage`` is False (a
worker that ignores the field).

``die(after=k, how=...)``: on its next request it sends ``k`` events and then ``reset`` (RST),
``close`` (FIN, chunked body unfinished), ``error`` (an error event, then a clean end, as an
engine that died does) or ``stall`` (nothing more); with ``k`` past the last event, it sends
``[DONE]`` and then resets before the chunked body's end.  ``bodies`` holds every request body,
``headers`` every request's headers.  A request whose connection the client closes before the
answer's end is aborted, as an engine does: it stops streaming, and ``aborted`` records when (the
loop's time), one entry per request.
"""

from __future__ import annotations

import asyncio
import json

import httptools

from helpers.fault_worker import _chunk, _head, _reset

PROMPT = "Tell me a story."
PROMPT_IDS = [5, 6, 7]
PROMPT_TOKENS = 10  # what the worker reports for the prompt before any continuation
ID0 = 1000
_GAP_S = 0.05


class _Conn(asyncio.Protocol):
    def __init__(self, w: "ScriptWorker") -> None:
        self.w = w
        self.transport = None
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.body = bytearray()
        self.task: asyncio.Task | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.w.live.add(self)

    def connection_lost(self, exc) -> None:
        self.w.live.discard(self)
        if self.task is not None:
            self.task.cancel()

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.abort()

    def on_message_begin(self) -> None:
        self.body = bytearray()
        self.url = b""
        self.hdrs = {}

    def on_header(self, name: bytes, value: bytes) -> None:
        self.hdrs[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        path = self.url.decode()
        if path.startswith("/health"):
            self.transport.write(_head(200, "application/json", length=2) + b"{}")
            return
        req = json.loads(bytes(self.body))
        self.w.bodies.append((path, req))
        self.w.headers.append(self.hdrs)
        self.task = asyncio.get_running_loop().create_task(self.w._serve(self, path, req))


def _bad(msg: str) -> bytes:
    body = json.dumps({"error": {"message": msg, "type": "invalid_request_error", "param": None,
                                 "code": None}}).encode()
    return _head(400, "application/json", length=len(body)) + body


class ScriptWorker:
    """The worker (``name`` appears in its ids); ``await start()`` / ``await close()`` in the test's loop."""

    def __init__(self, name: str, script: list[str], delay_s: float = 0.0, tokens_per_chunk: int = 1,
                 honors_continuous_usage: bool = True) -> None:
        self.name = name
        self.script = script
        self.tokens_per_chunk = tokens_per_chunk
        self.honors_continuous_usage = honors_continuous_usage
        self.delay_s = delay_s  # between events
        self.bodies: list[tuple[str, dict]] = []
        self.headers: list[dict[str, str]] = []  # each request's headers (lower-case names), as bodies
        self.live: set[_Conn] = set()
        self.dying: tuple[int, str] | None = None
        self.sent_events = 0
        self.aborted: list[float] = []  # loop times of requests cut short by their client closing the connection
        self._server = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> "ScriptWorker":
        self._server = await asyncio.get_running_loop().create_server(lambda: _Conn(self), "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        self._server.close()
        for c in list(self.live):
            c.transport.abort()
        await self._server.wait_closed()

    def answer_connections(self) -> int:
        """Connections still open that carried an answer request (the router's proxy path; a health
        check's kept-alive connection is not one)."""
        return sum(1 for c in self.live if c.task is not None)

    def die(self, after: int, how: str = "reset") -> None:
        assert how in ("reset", "close", "error", "stall")
        self.dying = (after, how)

    # -- the answer
    def _done_tokens(self, path: str, req: dict) -> int | str:
        """How many script tokens the request says were produced already (or an error message)."""
        def from_text(got: str, base: str) -> int | str:
            if not got.startswith(base):
                return f"prompt does not start with {base!r}: {got!r}"
            rest = got[len(base):]
            for j in range(len(self.script) + 1):
                if "".join(self.script[:j]) == rest:
                    return j
            return f"{rest!r} is not a prefix of the script"

        if path == "/generate":
            if "input_ids" in req:
                ids = req["input_ids"]
                if ids[:len(PROMPT_IDS)] != PROMPT_IDS:
                    return f"input_ids do not start with the prompt: {ids}"
                tail = ids[len(PROMPT_IDS):]
                if tail != [ID0 + j for j in range(len(tail))]:
                    return f"{tail} are not the script's first ids"
                return len(tail)
            return from_text(req["text"], PROMPT)
        if path == "/v1/completions":
            return from_text(req["prompt"], PROMPT)
        msgs = req["messages"]
        if req.get("continue_final_message") is True:
            if req.get("add_generation_prompt") is not False or msgs[-1]["role"] != "assistant":
                return "continue_final_message needs a last assistant message and add_generation_prompt false"
            return from_text(msgs[-1]["content"], "")
        return 0

    def _limit(self, path: str, req: dict) -> int:
        if path == "/generate":
            return (req.get("sampling_params") or {}).get("max_new_tokens", 128)
        if path == "/v1/completions":
            return req.get("max_tokens") or 16
        return req.get("max_completion_tokens") or req.get("max_tokens") or 10 ** 6

    def _events(self, path: str, req: dict, j: int) -> list[dict]:
        n = min(len(self.script) - j, self._limit(path, req))
        reason = "stop" if j + n == len(self.script) else "length"
        toks = self.script[j:j + n]
        rid, created = f"{self.name}-{len(self.bodies)}", 1700000000 + len(self.bodies)
        usage = lambda c: {"prompt_tokens": PROMPT_TOKENS + j, "completion_tokens": c,  # noqa: E731
                           "total_tokens": PROMPT_TOKENS + j + c,
                           # every prompt token cached: a continuation's prompt is longer than the original
                           "prompt_tokens_details": {"cached_tokens": PROMPT_TOKENS + j}}
        out: list[dict] = []
        if path == "/generate":
            for i in range(n):
                meta = {"id": rid, "prompt_tokens": PROMPT_TOKENS + j, "completion_tokens": i + 1,
                        "cached_tokens": PROMPT_TOKENS + j,
                        "finish_reason": ({"type": reason} if reason == "stop" else {"type": reason, "length": n})
                        if i == n - 1 else None}  # SGLang's: a length finish names the tokens generated
                out.append({"text": "".join(toks[:i + 1]), "output_ids": [ID0 + j + k for k in range(i + 1)],
                            "meta_info": meta})
            return out
        chat = path == "/v1/chat/completions"
        obj = "chat.completion.chunk" if chat else "text_completion"
        base = {"id": rid, "object": obj, "created": created, "model": "script"}
        k = self.tokens_per_chunk
        pieces = ["".join(toks[i:i + k]) for i in range(0, n, k)]
        ends = [min(i + k, n) for i in range(0, n, k)]  # completion tokens once each piece is out
        if chat:
            out.append(({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                              "finish_reason": None}]}, 0))
            out += [({**base, "choices": [{"index": 0, "delta": {"content": t}, "finish_reason": None}]}, c)
                    for t, c in zip(pieces, ends)]
            out.append(({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": reason}]}, n))
        else:
            out += [({**base, "choices": [{"index": 0, "text": t, "finish_reason": reason if c == n else None}]}, c)
                    for t, c in zip(pieces, ends)]
        opts = req.get("stream_options") or {}
        if opts.get("include_usage") and opts.get("continuous_usage_stats") and self.honors_continuous_usage:
            out = [{**ev, "usage": usage(c)} for ev, c in out]
        else:
            out = [ev for ev, _ in out]
        if opts.get("include_usage"):
            out.append({**base, "choices": [], "usage": usage(n)})
        return out

    async def _serve(self, conn: _Conn, path: str, req: dict) -> None:
        try:
            await self._answer(conn, path, req)
        except asyncio.CancelledError:  # connection_lost: the client went away mid-answer
            self.aborted.append(asyncio.get_running_loop().time())
            raise

    async def _answer(self, conn: _Conn, path: str, req: dict) -> None:
        t = conn.transport
        j = self._done_tokens(path, req)
        if isinstance(j, str):
            t.write(_bad(j))
            return
        dying, self.dying = self.dying, None
        t.write(_head(200, "text/event-stream"))
        for k, ev in enumerate(self._events(path, req, j)):
            if dying is not None and k == dying[0]:
                await asyncio.sleep(_GAP_S)  # the events reach the router before the fault
                how = dying[1]
                if how == "reset":
                    _reset(t)
                elif how == "close":
                    t.close()
                elif how == "error":
                    err = {"error": {"message": "engine died", "type": "internal_error", "param": None,
                                     "code": 503}}
                    t.write(_chunk(b"data: " + json.dumps(err).encode() + b"\n\n") + b"0\r\n\r\n")
                return  # stall: nothing more
            t.write(_chunk(b"data: " + json.dumps(ev).encode() + b"\n\n"))
            self.sent_events += 1
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
        if dying is not None:  # asked to die after more events than there are: after [DONE], before the body's end
            t.write(_chunk(b"data: [DONE]\n\n"))
            await asyncio.sleep(_GAP_S)
            _reset(t)
            return
        t.write(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
