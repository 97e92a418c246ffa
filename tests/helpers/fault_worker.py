"""A fake LLM worker that fails on command, for the router's fault tests.

A raw asyncio server (requests parsed by ``httptools``, answers written by
hand, byte for byte) that answers like a worker -- JSON for a plain request,
SSE (chunked) for ``"stream": true`` -- until :meth:`FaultWorker.arm` tells
it to misbehave on the next ``times`` occasions.  Each fault is a way a real
worker connection fails:

============================  ==========================================================
fault                         what the worker does
============================  ==========================================================
``refuse``                    stops listening (connections are refused); see :meth:`refuse`
``reset_on_accept``           accepts, then resets the connection (RST) before reading a byte
``reset_mid_request``         resets after the first bytes of the request (the router is
                              still writing when the body is large)
``reset_before_status``       reads the whole request, resets without answering
``close_before_status``       reads the whole request, closes (FIN) without answering
``reset_mid_headers``         sends half a header section, then resets
``garbage``                   answers bytes that are not HTTP
``reset_mid_body``            sends the headers and 20 of 200 announced body bytes, resets
``close_mid_body``            as ``reset_mid_body``, but closes (FIN)
``stall_before_status``       reads the request and never answers
``stall_mid_body``            sends the headers and part of the body, then nothing
``reset_before_first_event``  sends SSE headers, then resets before any event
``reset_mid_stream``          sends two SSE events, then resets
``close_mid_stream``          sends two SSE events, then closes without the last chunk
``stall_mid_stream``          sends one SSE event, then nothing
``keepalive_reset``           on a *reused* keep-alive connection: resets when the next
                              request arrives (a fresh connection is answered normally)
``close_idle``                answers normally (keep-alive), then closes the connection
``eof_body``                  answers without Content-Length or chunking: the body ends where the
                              connection does (FIN), which is a complete answer (RFC 9112 6.3)
``status``                    answers ``params["status"]`` with ``params["body"]`` (bytes)
                              and ``params["headers"]`` (pairs), keep-alive
============================  ==========================================================

Every normal answer names the worker (``"worker": name``), and ``GET /health``
is always answered 200.  Counters: ``connections``, ``requests`` (complete
requests read, health checks apart), ``health``, ``answered`` (normal answers), ``faults_done``.
Use it in the event loop of the test (``await w.start()``, ``await w.close()``).
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct

import httptools

FAULTS = ("reset_on_accept", "reset_mid_request", "reset_before_status", "close_before_status",
          "reset_mid_headers", "garbage", "reset_mid_body", "close_mid_body", "stall_before_status",
          "stall_mid_body", "reset_before_first_event", "reset_mid_stream", "close_mid_stream",
          "stall_mid_stream", "keepalive_reset", "close_idle", "eof_body", "status")
_ON_ACCEPT = ("reset_on_accept", "reset_mid_request")
_GAP_S = 0.05  # between bytes sent and the reset, so the bytes reach the router before the RST


def _reset(transport: asyncio.Transport) -> None:
    """Close with an RST (SO_LINGER 0) instead of a FIN."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    transport.abort()


def _head(status: int, ctype: str, extra: list[tuple[str, str]] = (), length: int | None = None) -> bytes:
    lines = [f"HTTP/1.1 {status} X", f"Content-Type: {ctype}"]
    lines.append("Transfer-Encoding: chunked" if length is None else f"Content-Length: {length}")
    lines += [f"{k}: {v}" for k, v in extra]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


class _Conn(asyncio.Protocol):
    def __init__(self, worker: "FaultWorker") -> None:
        self.w = worker
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.n_requests = 0
        self.body = bytearray()
        self.url = b""
        self.method = b""
        self.reset_on_data = False
        self.later: list[asyncio.TimerHandle] = []

    # -- asyncio
    def connection_made(self, transport) -> None:
        self.transport = transport
        w = self.w
        w.connections += 1
        w.live.add(self)
        fault = w._take(_ON_ACCEPT)
        if fault == "reset_on_accept":
            _reset(transport)
        elif fault == "reset_mid_request":
            self.reset_on_data = True

    def data_received(self, data: bytes) -> None:
        if self.reset_on_data:
            self.reset_on_data = False
            _reset(self.transport)
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.abort()

    def connection_lost(self, exc) -> None:
        self.w.live.discard(self)
        for h in self.later:
            h.cancel()

    # -- httptools
    def on_message_begin(self) -> None:
        self.body = bytearray()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.method, url, self.url = self.parser.get_method(), self.url, b""
        self.n_requests += 1
        w = self.w
        if url.startswith(b"/health"):
            w.health += 1
            self._write(_head(200, "application/json", length=11) + b'{"ok":true}')
            return
        w.requests += 1
        try:
            req = json.loads(bytes(self.body) or b"{}")
        except ValueError:
            req = {}
        stream = isinstance(req, dict) and req.get("stream") is True
        kinds = ("keepalive_reset",) if self.n_requests > 1 else ()
        fault = w._take(kinds + tuple(f for f in FAULTS if f not in _ON_ACCEPT and f != "keepalive_reset"))
        if fault is None:
            self._answer(stream)
            return
        w.faults_done += 1
        getattr(self, "_f_" + fault)(stream)

    # -- answers
    def _write(self, data: bytes) -> None:
        if not self.transport.is_closing():
            self.transport.write(data)

    def _after(self, delay: float, fn, *args) -> None:
        self.later.append(asyncio.get_running_loop().call_later(delay, fn, *args))

    def _event(self, i: int) -> bytes:
        return b"data: " + json.dumps({"worker": self.w.name, "i": i}).encode() + b"\n\n"

    def _answer(self, stream: bool) -> None:
        self.w.answered += 1
        if stream:
            self._write(_head(200, "text/event-stream") + b"".join(_chunk(self._event(i)) for i in range(3))
                        + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        else:
            body = json.dumps({"worker": self.w.name, "text": "ok"}).encode()
            self._write(_head(200, "application/json", length=len(body)) + body)

    def _f_reset_before_status(self, stream):
        _reset(self.transport)

    def _f_keepalive_reset(self, stream):
        _reset(self.transport)

    def _f_close_before_status(self, stream):
        self.transport.close()

    def _f_reset_mid_headers(self, stream):
        self._write(b"HTTP/1.1 200 OK\r\nContent-Type: applicat")
        self._after(_GAP_S, _reset, self.transport)

    def _f_garbage(self, stream):
        self._write(b"SPDY/9 what is this\r\n\r\n\x00\x01")

    def _f_reset_mid_body(self, stream):
        self._write(_head(200, "application/json", length=200) + b'{"worker": "half",  ')
        self._after(_GAP_S, _reset, self.transport)

    def _f_close_mid_body(self, stream):
        self._write(_head(200, "application/json", length=200) + b'{"worker": "half",  ')
        self._after(_GAP_S, self.transport.close)

    def _f_stall_before_status(self, stream):
        pass

    def _f_stall_mid_body(self, stream):
        self._write(_head(200, "application/json", length=200) + b'{"worker": "half",  ')

    def _f_reset_before_first_event(self, stream):
        self._write(_head(200, "text/event-stream"))
        self._after(_GAP_S, _reset, self.transport)

    def _f_reset_mid_stream(self, stream):
        self._write(_head(200, "text/event-stream") + _chunk(self._event(0)) + _chunk(self._event(1)))
        self._after(_GAP_S, _reset, self.transport)

    def _f_close_mid_stream(self, stream):
        self._write(_head(200, "text/event-stream") + _chunk(self._event(0)) + _chunk(self._event(1)))
        self._after(_GAP_S, self.transport.close)

    def _f_stall_mid_stream(self, stream):
        self._write(_head(200, "text/event-stream") + _chunk(self._event(0)))

    def _f_close_idle(self, stream):
        self._answer(stream)
        self._after(_GAP_S, self.transport.close)

    def _f_eof_body(self, stream):
        body = json.dumps({"worker": self.w.name, "text": "ok, until the end of the connection"}).encode()
        self._write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n" + body)
        self.transport.close()

    def _f_status(self, stream):
        p = self.w.params
        body = p.get("body", b"")
        self._write(_head(p["status"], p.get("content_type", "application/json"), p.get("headers", ()),
                          length=len(body)) + body)


class FaultWorker:
    """The worker; ``name`` appears in its answers."""

    def __init__(self, name: str = "fault") -> None:
        self.name = name
        self.connections = self.requests = self.health = self.answered = self.faults_done = 0
        self.live: set[_Conn] = set()
        self.fault: str | None = None
        self.times = 0
        self.params: dict = {}
        self._server: asyncio.AbstractServer | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> "FaultWorker":
        self._server = await asyncio.get_running_loop().create_server(lambda: _Conn(self), "127.0.0.1",
                                                                      self.port or 0, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def arm(self, fault: str, times: int = 1, **params) -> None:
        """Misbehave as ``fault`` on its next ``times`` occasions (see the module table)."""
        if fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}")
        self.fault, self.times, self.params = fault, times, params

    def disarm(self) -> None:
        self.fault, self.times = None, 0

    def _take(self, kinds) -> str | None:
        if self.times > 0 and self.fault in kinds:
            self.times -= 1
            return self.fault
        return None

    async def refuse(self) -> None:
        """Stop listening: new connections are refused until :meth:`start` listens again (same port)."""
        self._server.close()
        await self._server.wait_closed()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for c in list(self.live):
            c.transport.abort()
        if self._server is not None:
            await self._server.wait_closed()
