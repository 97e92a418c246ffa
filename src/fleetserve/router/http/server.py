"""A lean HTTP/1.1 server for the router, on asyncio (uvloop) with ``httptools`` parsing.

Why not aiohttp's server: with the upstream client made lean, py-spy showed
aiohttp's request/response objects, router and writer as the largest Python
cost per proxied request (docs/router.md).  This module keeps only what the
router needs; the parsing itself is done by ``httptools`` (llhttp, as in
uvicorn), never by hand.

What it does:

* keep-alive and pipelined requests, answered in order (errors too), one
  handler at a time per connection; reading pauses while 32 requests wait or
  the client does not read its answers;
* ``Expect: 100-continue``; a body announced over ``max_body`` bytes is
  answered 413 as soon as the headers are in, never buffered, and the
  connection is closed; a target over 8 KiB gets 414, headers over 64 KiB
  431, and a request still incomplete after the idle timeout 408;
* a handler returns a :class:`Response`, or streams with
  :meth:`Request.start_stream` / :meth:`Request.write` / :meth:`Request.end_stream`
  (chunked transfer encoding, writes wait while the socket buffer is full);
* the client going away cancels the running handler (``CancelledError`` in it),
  so the proxy drops its upstream request at once;
* unknown path 404, known path with another method 405, malformed request 400,
  all as OpenAI-style JSON errors.
"""

from __future__ import annotations

import asyncio
import socket
import collections
import logging
from http import HTTPStatus
from urllib.parse import parse_qs

import httptools
import orjson

from .turn import Arrivals

log = logging.getLogger("fleetserve.router")

_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
_WRITE_HIGH = 256 * 1024
MAX_URL_BYTES = 8192  # longer request targets get 414 (aiohttp's and uvicorn's limit is 8190 / 8192 too)
MAX_HEAD_BYTES = 64 * 1024  # all header names and values of one request; more gets 431
_MAX_QUEUED = 32  # pipelined requests buffered per connection before reading pauses
_NO_BODY = frozenset({204, 304})


def _status_line(status: int) -> bytes:
    return b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Unknown"))


class Response:
    """A complete response: ``status``, ``body`` bytes, ``content_type`` and extra ``headers`` pairs."""

    __slots__ = ("status", "body", "content_type", "headers")

    def __init__(self, status: int = 200, body: bytes = b"", content_type: str = "application/json",
                 headers: list[tuple[str, str]] | None = None) -> None:
        self.status = status
        self.body = body
        self.content_type = content_type
        self.headers = headers


def json_response(obj, status: int = 200) -> Response:
    return Response(status, orjson.dumps(obj))


def error_body(message: str, err_type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """``{"error": {"message", "type", "param", "code"}}``, as OpenAI's API writes it.

    ``code`` follows OpenAI's convention: a string a client can act on
    (``"no_healthy_worker"``, ``"upstream_timeout"``, ...) or null, never the
    HTTP status (that is the response's status line).
    """
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def json_error(status: int, message: str, err_type: str = "invalid_request_error",
               param: str | None = None, code: str | None = None) -> Response:
    """An OpenAI-style JSON error response (see :func:`error_body`); ``status`` is the HTTP status."""
    return Response(status, orjson.dumps(error_body(message, err_type, param, code)))


class HeadResponse(Response):
    """The answer to a HEAD request: the GET answer ``resp``'s status and headers, sent without its body."""

    __slots__ = ()

    def __init__(self, resp: Response) -> None:
        super().__init__(resp.status, resp.body, resp.content_type, resp.headers)


class Request:
    """One parsed request.  ``headers``: lower-case name -> value (last one wins)."""

    __slots__ = ("method", "path", "query_string", "headers", "body", "_proto", "_streaming", "keep_alive")

    def __init__(self, proto: "HttpProtocol", method: str, path: str, query_string: str,
                 headers: dict[str, str], body: bytes, keep_alive: bool) -> None:
        self._proto = proto
        self.method = method
        self.path = path
        self.query_string = query_string
        self.headers = headers
        self.body = body
        self.keep_alive = keep_alive
        self._streaming = False

    @property
    def query(self) -> dict[str, str]:
        """Query parameters, first value of each."""
        return {k: v[0] for k, v in parse_qs(self.query_string).items()}

    # -- streaming
    def start_stream(self, status: int, content_type: str, headers: list[tuple[str, str]] | None = None) -> None:
        """Send the status line and headers of a chunked response.  Raises ``ConnectionResetError`` if gone."""
        proto = self._proto
        if proto.closed:
            raise ConnectionResetError("client went away")
        self._streaming = True
        head = [_status_line(status), b"Content-Type: ", content_type.encode("latin-1"),
                b"\r\nTransfer-Encoding: chunked\r\n"]
        for k, v in headers or ():
            head += [k.encode("latin-1"), b": ", v.encode("latin-1"), b"\r\n"]
        if not self.keep_alive:
            head.append(b"Connection: close\r\n")
        head.append(b"\r\n")
        proto.transport.write(b"".join(head))

    async def write(self, data: bytes) -> None:
        """Send one chunk now; waits while the client reads slower than we write."""
        proto = self._proto
        if proto.closed:
            raise ConnectionResetError("client went away")
        if data:
            proto.transport.write(b"%x\r\n%b\r\n" % (len(data), data))
        if proto.write_paused:
            await proto.drain()

    def end_stream(self) -> None:
        """Send the last chunk."""
        proto = self._proto
        if proto.closed:
            raise ConnectionResetError("client went away")
        proto.transport.write(b"0\r\n\r\n")


class HttpProtocol(asyncio.Protocol):
    """One client connection."""

    def __init__(self, routes: dict[str, dict[str, object]], max_body: int,
                 live: set["HttpProtocol"] | None = None,
                 prefixes: tuple[tuple[str, dict[str, object]], ...] = (), arrivals: Arrivals | None = None) -> None:
        self.routes = routes
        self.arrivals = arrivals  # counted into while a request waits for its handler (turn.py); None: not counted
        self._arrived = False  # this connection's request is counted in arrivals
        self.prefixes = prefixes  # (path prefix, method -> handler), tried when no exact path matches
        self.live = live
        self.idle_since: float | None = None
        self.max_body = max_body
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.closed = False
        self.write_paused = False
        self._drain: asyncio.Future | None = None
        self._queue: collections.deque[Request | Response] = collections.deque()
        self._task: asyncio.Task | None = None
        self._url = b""
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []
        self._size = 0
        self._too_large = False
        self._head_size = 0
        self._dead = False  # answered with an error to be followed by closing: ignore further input
        self._close_after_body = False
        self._reading_paused = False
        self.receiving_since: float | None = None  # a request started and not yet complete

    # -- asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport
        self.idle_since = self.loop.time()
        if self.live is not None:
            self.live.add(self)

    def connection_lost(self, exc) -> None:
        self.closed = True
        self._started()  # a handler task cancelled before it started never runs its first line
        if self.live is not None:
            self.live.discard(self)
        self._queue.clear()
        if self._task is not None and not self._task.done():
            self._task.cancel()
        if self._drain is not None and not self._drain.done():
            self._drain.set_exception(ConnectionResetError("client went away"))

    def pause_writing(self) -> None:
        self.write_paused = True
        self._update_reading()

    def resume_writing(self) -> None:
        self.write_paused = False
        self._update_reading()
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    def _update_reading(self) -> None:
        """Back-pressure: stop reading while the client does not read our answers or has too many
        pipelined requests waiting, so one connection cannot make the router buffer without bound."""
        pause = self.write_paused or len(self._queue) >= _MAX_QUEUED
        if pause != self._reading_paused and not self.closed:
            self._reading_paused = pause
            if pause:
                self.transport.pause_reading()
            else:
                self.transport.resume_reading()

    async def drain(self) -> None:
        if self.closed:
            raise ConnectionResetError("client went away")
        if self.write_paused:
            self._drain = self.loop.create_future()
            await self._drain

    def data_received(self, data: bytes) -> None:
        if self._dead:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._reply_and_close(json_error(400, "protocol upgrades are not supported"))
        except httptools.HttpParserError as e:
            if not self._dead:  # (a callback may already have answered, e.g. 414 / 431)
                self._reply_and_close(json_error(400, f"malformed HTTP request: {e}"))

    # -- httptools callbacks
    def on_message_begin(self) -> None:
        if self._dead:
            return
        self.idle_since = None
        self.receiving_since = self.loop.time()
        self._url = b""
        self._headers = {}
        self._body = []
        self._size = 0
        self._head_size = 0
        self._too_large = False

    def on_url(self, url: bytes) -> None:
        if self._dead:
            return
        self._url += url
        if len(self._url) > MAX_URL_BYTES:
            self._reply_and_close(json_error(414, f"request target longer than {MAX_URL_BYTES} bytes"))

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._dead:
            return
        self._head_size += len(name) + len(value)
        if self._head_size > MAX_HEAD_BYTES:
            self._reply_and_close(json_error(431, f"request headers longer than {MAX_HEAD_BYTES} bytes"))
            return
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        if self._dead:
            return
        length = self._headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            too_large = json_error(413, f"request body exceeds --max-payload-size {self.max_body} bytes",
                                    code="payload_too_large")
            if self._headers.get("expect", "").lower() == "100-continue":
                self._reply_and_close(too_large)  # the client waits for our word before sending the body
            elif self._task is None and not self._queue:
                # answer now, but read and drop the body before closing: closing with unread
                # bytes would reset the connection and could destroy the answer on the way
                self._send(too_large, False)
                self._too_large = self._close_after_body = True
            else:
                self._too_large = True  # answered in turn when the body is complete
        elif (self._headers.get("expect", "").lower() == "100-continue" and not self._queue
              and self._task is None):
            # only when no earlier answer is owed on this connection: a 100 must not overtake a
            # final response (otherwise the client sends the body after its own wait)
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        if self._too_large or self._dead:
            return
        self._size += len(body)
        if self._size > self.max_body:
            self._too_large = True
            self._body = []
        else:
            self._body.append(body)

    def on_message_complete(self) -> None:
        if self._dead:
            return
        self.receiving_since = None
        if self._close_after_body:  # the 413 went out already
            self._dead = True
            self.transport.close()
            return
        if self._too_large:  # a body that outgrew the limit
            self._reply_and_close(json_error(413, f"request body exceeds --max-payload-size {self.max_body} bytes",
                                    code="payload_too_large"))
            return
        else:
            url = self._url.decode("latin-1")
            if url.startswith(("http://", "https://")):  # absolute form (RFC 9112 3.2.2): keep path and query
                url = "/" + url.split("://", 1)[1].partition("/")[2]
            path, _, query = url.partition("?")
            body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
            self._queue.append(Request(self, self.parser.get_method().decode("latin-1"), path, query,
                                       self._headers, body, self.parser.should_keep_alive()))
        if self._task is None:
            self._task = self.loop.create_task(self._serve_queue())
            if self.arrivals is not None:  # read, its handler not started: the upstream client waits for it (turn.py)
                self.arrivals.waiting += 1
                self._arrived = True
        self._update_reading()

    # -- handling
    def _started(self) -> None:
        """This connection's counted request is no longer waiting for its handler (turn.py)."""
        if self._arrived:
            self._arrived = False
            self.arrivals.waiting -= 1

    async def _serve_queue(self) -> None:
        self._started()
        try:
            while self._queue and not self.closed:
                item = self._queue.popleft()
                if self._reading_paused:
                    self._update_reading()
                if item is None:
                    self.transport.close()
                    return
                if isinstance(item, Response):  # a 413: answered, then the connection closes
                    self._send(item, False)
                    continue
                keep = item.keep_alive
                resp = await self._dispatch(item)
                if self.closed:
                    return
                if item._streaming:
                    if not keep:
                        self.transport.close()
                        return
                    continue
                self._send(resp, keep)
                if not keep:
                    self.transport.close()
                    return
        except asyncio.CancelledError:
            pass
        finally:
            self._task = None
            self.idle_since = self.loop.time()

    async def _dispatch(self, req: Request) -> Response | None:
        by_method = self.routes.get(req.path)
        if by_method is None:
            by_method = self._by_prefix(req.path)
        head = req.method == "HEAD"  # RFC 9110 9.3.2: HEAD is GET without the body, whatever the answer
        if by_method is None:
            resp = json_error(404, f"no route for {req.path}", "not_found_error")
            return HeadResponse(resp) if head else resp
        handler = by_method.get(req.method)
        if handler is None and head:
            handler = by_method.get("GET")
        if handler is None:  # RFC 9110 15.5.6: a 405 names the methods the path takes, in Allow
            resp = json_error(405, f"{req.method} is not allowed on {req.path}")
            allowed = set(by_method) | ({"HEAD"} if "GET" in by_method else set())
            resp.headers = [("Allow", ", ".join(sorted(allowed)))]
            return HeadResponse(resp) if head else resp
        try:
            if head:
                resp = await handler(req)
                return resp if resp is None else HeadResponse(resp)
            return await handler(req)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as e:  # a bug must not take the connection down silently
            log.exception("handler for %s failed", req.path)
            if req._streaming:
                self.transport.close()
                return None
            resp = json_error(500, f"internal router error: {type(e).__name__}: {e}", "internal_error")
            return HeadResponse(resp) if head else resp

    def _by_prefix(self, path: str) -> dict[str, object] | None:
        for prefix, by_method in self.prefixes:
            if path.startswith(prefix) and len(path) > len(prefix):
                return by_method
        return None

    def _send(self, resp: Response, keep_alive: bool) -> None:
        body = resp.body
        if type(resp) is HeadResponse:  # the GET answer's headers, Content-Length included, and no body
            parts = [_status_line(resp.status), b"Content-Type: ", resp.content_type.encode("latin-1"),
                     b"\r\nContent-Length: ", str(len(body)).encode(), b"\r\n"]
            body = b""
        elif resp.status in _NO_BODY:  # no body, so no Content-Length or Content-Type (RFC 9110 8.6, 15.3.5)
            body = b""
            parts = [_status_line(resp.status)]
        else:
            parts = [_status_line(resp.status), b"Content-Type: ", resp.content_type.encode("latin-1"),
                     b"\r\nContent-Length: ", str(len(body)).encode(), b"\r\n"]
        if resp.headers:
            for k, v in resp.headers:
                parts += [k.encode("latin-1"), b": ", v.encode("latin-1"), b"\r\n"]
        if not keep_alive:
            parts.append(b"Connection: close\r\n")
        parts += [b"\r\n", body]
        self.transport.write(b"".join(parts))

    def _reply_and_close(self, resp: Response) -> None:
        """Answer ``resp`` after any answers still owed on this connection, then close it; read no more."""
        if self.closed or self._dead:
            return
        self._dead = True
        self.receiving_since = None
        if self._task is None and not self._queue:
            self._send(resp, False)
            self.transport.close()
            return
        self._queue.append(resp)
        self._queue.append(None)  # then close
        if self._task is None:
            self._task = self.loop.create_task(self._serve_queue())


class Routes:
    """path -> method -> async handler(Request) -> Response | None.

    :meth:`add_prefix` routes every longer path under a prefix (``/workers/``
    then a worker url) when no exact path matches; the handler reads the rest
    of ``request.path`` itself.
    """

    def __init__(self) -> None:
        self.table: dict[str, dict[str, object]] = {}
        self.prefixes: dict[str, dict[str, object]] = {}

    def add(self, method: str, path: str, handler) -> None:
        self.table.setdefault(path, {})[method] = handler

    def add_prefix(self, method: str, prefix: str, handler) -> None:
        self.prefixes.setdefault(prefix, {})[method] = handler


def idle_check_interval(idle_timeout_s: float) -> float:
    """Seconds between two passes of :func:`_close_idle`: a quarter of the timeout, at most 1 s (so a late
    client's 408 comes at most a second past the timeout) and at least 50 ms."""
    return min(1.0, max(0.05, idle_timeout_s / 4))


async def _close_idle(live: set[HttpProtocol], idle_timeout_s: float) -> None:
    """Close client connections that sat idle (no request in progress) for ``idle_timeout_s``, and
    those still sending one request after ``idle_timeout_s`` (a slow or stalled client, slowloris)."""
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(idle_check_interval(idle_timeout_s))
        now = loop.time()
        for proto in list(live):
            since = proto.idle_since
            if since is not None and proto._task is None and now - since > idle_timeout_s:
                proto.transport.close()
            started = proto.receiving_since
            if started is not None and now - started > idle_timeout_s:
                if proto._close_after_body:  # answered 413 already; the announced body never came
                    proto.transport.close()
                else:
                    proto._reply_and_close(json_error(408, f"request not received within {idle_timeout_s:g} s"))


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (first address ``host`` resolves to), not listening yet.

    Binding early lets a caller refuse a busy port before a long wait; until
    :func:`start_server` listens on it, connections to it are refused.  Raises
    ``OSError`` (e.g. ``EADDRINUSE``, or ``socket.gaierror`` for an unknown host).
    """
    family, type_, proto, _, addr = socket.getaddrinfo(host or None, port, socket.AF_UNSPEC, socket.SOCK_STREAM,
                                                       0, socket.AI_PASSIVE)[0]
    sock = socket.socket(family, type_, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as create_server's reuse_address=True
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(addr)
    except BaseException:
        sock.close()
        raise
    return sock


async def start_server(routes: Routes, host: str | None, port: int | None, max_body: int, backlog: int = 1024,
                       idle_timeout_s: float = 75.0, sock: socket.socket | None = None,
                       arrivals: Arrivals | None = None) -> "ListeningServer":
    """Listen on ``host:port`` (or on ``sock``, from :func:`bind_socket`); returns a :class:`ListeningServer`.

    Close it to stop.  Keep-alive client connections idle for ``idle_timeout_s``
    seconds are closed (aiohttp's server default is 75 s).  ``arrivals``: the upstream pool's
    count of requests read and not yet handled (:mod:`.turn`), for the router's main server.
    """
    loop = asyncio.get_running_loop()
    live: set[HttpProtocol] = set()
    prefixes = tuple(routes.prefixes.items())
    factory = lambda: HttpProtocol(routes.table, max_body, live, prefixes, arrivals)  # noqa: E731
    if sock is not None:
        server = await loop.create_server(factory, sock=sock, backlog=backlog)
    else:
        server = await loop.create_server(factory, host, port, backlog=backlog, reuse_address=True)
    return ListeningServer(server, loop.create_task(_close_idle(live, idle_timeout_s)), live)


class ListeningServer:
    """A started server: ``sockets`` as in ``asyncio.Server``; ``close()`` stops listening and the idle reaper."""

    def __init__(self, server: asyncio.Server, reaper: asyncio.Task, live: set[HttpProtocol]) -> None:
        self.server = server
        self.reaper = reaper
        self.live = live  # the open client connections

    @property
    def sockets(self):
        return self.server.sockets

    def close(self) -> None:
        self.server.close()
        self.reaper.cancel()
