"""A lean keep-alive HTTP/1.1 client for the router's hot path.

Why not aiohttp's client: profiling the router (py-spy, docs/router.md) showed
aiohttp's ``ClientSession.request`` machinery costing more per request than
everything else the router does.  This client does only what the proxy needs:
POST a body that is already bytes, read the status and headers, then either
the whole body or the body chunk by chunk.  Responses are parsed by
``httptools`` (the llhttp parser used by uvicorn); no HTTP parsing is done here.

One :class:`UpstreamPool` per router; it keeps idle connections per worker
(``host:port``).  A request that fails on a *reused* idle connection before
any response byte arrived is sent once more on a fresh connection (the worker
may have closed the idle connection meanwhile), as aiohttp does.

Writes are coalesced: while requests that the server read together with this
one are still to be handled (:class:`.turn.Arrivals`), :meth:`UpstreamPool.post`
queues its request; the last of them writes every queued request at once, and
a request that arrives alone is written at once.  (As a backstop, whatever is
queued is also written at the end of the event-loop turn, ``loop.call_soon``.)
So the router parses and routes every request that arrived together before it
wakes any worker.  On the overhead stick, which runs the router and its workers
on one core, each write to a worker woke it and it preempted the router about
once per request either way (0.84 and 0.85 involuntary switches per request),
but now in the write loop rather than in the middle of the routing work
(docs/benchmarks.md ``router-overhead-coalesced-writes``).  A connection that
closes before its request is written fails that request as if the write had
failed (on a reused idle connection the request goes once more on a fresh
one), and the others are written.

Errors: every failure raises :class:`UpstreamError` (``UpstreamTimeoutError``
for the ``timeout`` bound, which covers the whole exchange, streaming included):
refused, reset or closed before or while the request is written, before the
status line, mid-headers or mid-body, a malformed answer.  Nothing else escapes
(tests/unit/router/test_router_worker_faults.py runs each of these).
"""

from __future__ import annotations

import asyncio
import collections
from urllib.parse import urlsplit

import httptools

from .turn import Arrivals


class UpstreamError(Exception):
    """The worker could not be reached, closed the connection, or sent a malformed response."""


class UpstreamTimeoutError(UpstreamError):
    """The exchange did not finish within its time bound."""


_HIGH_WATER = 1 << 20  # bytes buffered from a streaming worker before reading pauses


class _Conn(asyncio.Protocol):
    """One keep-alive connection; at most one exchange at a time."""

    __slots__ = ("pool", "key", "transport", "parser", "status", "headers", "chunks", "buffered", "done",
                 "error", "head_waiter", "body_waiter", "keep_alive", "got_bytes", "closed", "paused",
                 "interim", "extra", "in_pool", "header_pairs", "head_done", "epoch")

    def __init__(self, pool: "UpstreamPool", key: str) -> None:
        self.pool = pool
        self.key = key
        self.epoch = pool._epochs.get(key, 0)  # the pool's count of forget(key) when this connection opened
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.in_pool = False
        self._reset()

    def _reset(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: dict[str, str] = {}  # lower-case name -> value (repeats joined by ", ")
        self.header_pairs: list[tuple[str, str]] = []  # as received, repeats kept (Set-Cookie)
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.done = False
        self.error: BaseException | None = None
        self.head_waiter: asyncio.Future | None = None
        self.body_waiter: asyncio.Future | None = None
        self.keep_alive = True
        self.got_bytes = False
        self.paused = False
        self.interim = False  # inside a 1xx interim response (100 Continue, 103 Early Hints)
        self.extra = False  # bytes after the answer: a second response nobody asked for
        self.head_done = False  # the final answer's header section is complete (later fields are trailers)

    # -- asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.in_pool or self.done:
            # the worker sent something after its answer (or to an idle connection): whatever it
            # is, it must never reach another client, so this connection is not used again
            self.keep_alive = False
            if self.in_pool:
                self.closed = True
                self.transport.abort()
            return
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(UpstreamError(f"malformed response: {e}"))
            self.transport.abort()

    def connection_lost(self, exc) -> None:
        self.closed = True
        h = self.headers
        if (self.head_done and exc is None and not self.done
                and "content-length" not in h and "transfer-encoding" not in h):
            self.on_message_complete()  # a body delimited by the end of the connection
            return
        if not self.done:
            self._fail(UpstreamError(f"connection closed by the worker ({exc or 'EOF'})"))

    # -- httptools callbacks
    def on_message_begin(self) -> None:
        if self.done:  # a second response in the same packet as the first: drop it, close later
            self.extra = True
            self.keep_alive = False

    def on_status(self, status: bytes) -> None:
        if not self.extra:
            self.status = self.parser.get_status_code()

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.extra or self.head_done:  # chunked trailer fields are not headers (RFC 9110 6.5.2): drop them
            return
        key = name.decode("latin-1").lower()
        old = self.headers.get(key)
        value = value.decode("latin-1")
        self.headers[key] = value if old is None else f"{old}, {value}"  # repeated header: RFC 9110 5.3
        self.header_pairs.append((key, value))

    def on_headers_complete(self) -> None:
        if self.extra:
            return
        status = self.parser.get_status_code()
        if 100 <= status < 200:
            if status == 101:
                self._fail(UpstreamError("the worker switched protocols (101), which the router does not proxy"))
                self.transport.abort()
                return
            # an interim response: skip it and wait for the final one
            self.interim = True
            self.status = 0
            self.headers = {}
            self.header_pairs = []
            return
        self.status = status
        self.head_done = True
        self.keep_alive = self.parser.should_keep_alive()
        w = self.head_waiter
        if w is not None and not w.done():
            w.set_result(None)

    def on_body(self, body: bytes) -> None:
        if self.extra:
            return
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > _HIGH_WATER and not self.paused:
            self.paused = True
            self.transport.pause_reading()
        w = self.body_waiter
        if w is not None and not w.done():
            w.set_result(None)

    def on_message_complete(self) -> None:
        if self.extra:
            return
        if self.interim:
            self.interim = False
            return
        self.done = True
        for w in (self.head_waiter, self.body_waiter):
            if w is not None and not w.done():
                w.set_result(None)

    # -- helpers
    def _fail(self, err: BaseException) -> None:
        if self.error is None:
            self.error = err
        for w in (self.head_waiter, self.body_waiter):
            if w is not None and not w.done():
                w.set_exception(err)


class UpstreamResponse:
    """Status and headers of a worker's answer; read the body with :meth:`read` or :meth:`iter_chunks`.

    Always call :meth:`release` (the proxy does it in ``finally``): a fully read
    response returns its connection to the pool, anything else closes it.
    """

    __slots__ = ("status", "headers", "header_pairs", "_conn", "_timer", "_released")

    def __init__(self, conn: _Conn, timer: asyncio.TimerHandle | None) -> None:
        self.status = conn.status
        self.headers = conn.headers
        self.header_pairs = conn.header_pairs
        self._conn = conn
        self._timer = timer
        self._released = False

    @property
    def content_type(self) -> str:
        """The media type without parameters, lower case ('' if absent)."""
        return self.headers.get("content-type", "").split(";", 1)[0].strip().lower()

    async def read(self) -> bytes:
        """The whole body.  Raises :class:`UpstreamError` if the exchange fails."""
        c = self._conn
        while not c.done:
            if c.error is not None:
                raise c.error
            if c.paused:  # the stream back-pressure does not apply: we want it all
                c.paused = False
                if not c.closed:
                    c.transport.resume_reading()
            c.body_waiter = c.pool.loop.create_future()
            await c.body_waiter
            c.body_waiter = None
        if c.error is not None and not c.done:
            raise c.error
        data = b"".join(c.chunks)
        c.chunks.clear()
        return data

    async def next_chunk(self) -> bytes:
        """The next piece of body as it arrived, b'' at the end.  Raises :class:`UpstreamError`."""
        c = self._conn
        while True:
            if c.chunks:
                chunk = c.chunks.popleft()
                c.buffered -= len(chunk)
                if c.paused and c.buffered < _HIGH_WATER // 2:
                    c.paused = False
                    if not c.closed:
                        c.transport.resume_reading()
                return chunk
            if c.done:
                return b""
            if c.error is not None:
                raise c.error
            c.body_waiter = c.pool.loop.create_future()
            try:
                await c.body_waiter
            finally:
                c.body_waiter = None

    def release(self) -> None:
        """Give the connection back (body fully read, keep-alive) or close it."""
        if self._released:
            return
        self._released = True
        if self._timer is not None:
            self._timer.cancel()
        c = self._conn
        if c.done and c.keep_alive and not c.closed and not c.chunks and c.error is None and not c.extra:
            c.pool._put(c)
        else:
            c.closed = True
            if c.transport is not None:
                c.transport.abort()


class UpstreamPool:
    """Keep-alive connections to every worker, created on demand."""

    def __init__(self, timeout_s: float, max_idle_per_worker: int = 256) -> None:
        """``arrivals`` (set here): the count the router's main server keeps of requests read and not yet
        handled (:mod:`.turn`); pass it to that server's :func:`~.server.start_server`."""
        self.arrivals = Arrivals()
        self._write_scheduled = False  # a call_soon(_write_unsent) is pending
        self.loop = asyncio.get_running_loop()
        self.timeout_s = timeout_s
        self.max_idle = max_idle_per_worker
        self._idle: dict[str, list[_Conn]] = {}
        self._addr: dict[str, tuple[str, int, bytes]] = {}
        # how many times each worker was forgotten: a connection opened before the last time is not reused
        self._epochs: dict[str, int] = {}
        self._unsent: list[tuple[_Conn, bytes]] = []  # requests waiting for the others read with them

    def _queue_write(self, conn: _Conn, data: bytes) -> None:
        """Write ``data`` to ``conn`` with the requests read together with it (module docstring)."""
        self._unsent.append((conn, data))
        if not self.arrivals.waiting:  # the last of its arrivals to be handled (or alone): all go now
            self._write_unsent()
        elif not self._write_scheduled:  # else after the others; at the latest at the end of this turn
            self._write_scheduled = True
            self.loop.call_soon(self._write_unsent)

    def _write_unsent(self) -> None:
        self._write_scheduled = False
        unsent, self._unsent = self._unsent, []
        for conn, data in unsent:
            if conn.closed:  # it failed, timed out or was given up since (its waiter already knows)
                continue
            if conn.transport.is_closing():  # as in _exchange: writing now raises (uvloop) or is dropped
                conn.closed = True
                conn.transport.abort()
                conn._fail(conn.error or UpstreamError("connection closed by the worker before the request was sent"))
                continue
            try:
                conn.transport.write(data)
            except Exception as e:  # closed under us anyway (RuntimeError, OSError): this request fails, the rest go
                conn.closed = True
                conn.transport.abort()
                conn._fail(UpstreamError(f"cannot send the request to the worker: {e}"))

    def _target(self, base_url: str) -> tuple[str, int, bytes]:
        t = self._addr.get(base_url)
        if t is None:
            u = urlsplit(base_url)
            try:
                port = u.port or 80
            except ValueError:  # a port out of range or not a number
                port = 0
            if u.scheme != "http" or not u.hostname or not port:
                raise UpstreamError(f"unsupported worker URL {base_url!r} (plain http://host:port only)")
            t = self._addr[base_url] = (u.hostname, port, f"{u.netloc}".encode("latin-1"))
        return t

    def _put(self, conn: _Conn) -> None:
        if conn.epoch != self._epochs.get(conn.key, 0):  # in use when its worker was removed: closed, not kept
            conn.closed = True
            conn.transport.close()
            return
        if conn.paused:  # the body ended while reading was paused for back-pressure
            conn.transport.resume_reading()
        conn._reset()
        idle = self._idle.setdefault(conn.key, [])
        if len(idle) < self.max_idle:
            conn.in_pool = True
            idle.append(conn)
        else:
            conn.closed = True
            conn.transport.close()

    def forget(self, base_url: str) -> None:
        """Close the connections to a removed worker: the idle ones now, the ones in use when their
        exchange ends (:meth:`UpstreamResponse.release` closes them instead of keeping them).  A worker
        added again under the same url gets fresh connections."""
        self._epochs[base_url] = self._epochs.get(base_url, 0) + 1
        for c in self._idle.pop(base_url, []):
            c.closed = True
            c.transport.close()
        self._addr.pop(base_url, None)

    def close(self) -> None:
        for key in list(self._idle):
            self.forget(key)

    async def post(self, base_url: str, path: str, body: bytes, extra_headers: bytes = b"",
                   timeout_s: float | None = None) -> UpstreamResponse:
        """POST ``body`` (JSON bytes) to ``base_url + path``; returns once the status and headers arrived.

        ``extra_headers``: already formatted ``Name: value\\r\\n`` lines.  Raises :class:`UpstreamError`.
        """
        host, port, hosthdr = self._target(base_url)
        head = (b"POST " + path.encode("latin-1") + b" HTTP/1.1\r\nHost: " + hosthdr
                + b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode()
                + b"\r\n" + extra_headers + b"\r\n")
        timeout = self.timeout_s if timeout_s is None else timeout_s
        idle = self._idle.get(base_url)
        while idle:
            conn = idle.pop()
            conn.in_pool = False
            if conn.closed:
                continue
            try:
                return await self._exchange(conn, head, body, timeout)
            except UpstreamTimeoutError:
                raise
            except UpstreamError:
                if conn.got_bytes:
                    raise
                # the worker closed this idle connection before we used it: try a fresh one
                break
        try:
            _, conn = await asyncio.wait_for(
                self.loop.create_connection(lambda: _Conn(self, base_url), host, port), timeout)
        except asyncio.TimeoutError as e:
            raise UpstreamTimeoutError(f"connect to {base_url} timed out after {timeout} s") from e
        except OSError as e:
            raise UpstreamError(f"cannot connect to {base_url}: {e}") from e
        return await self._exchange(conn, head, body, timeout)

    async def _exchange(self, conn: _Conn, head: bytes, body: bytes, timeout: float) -> UpstreamResponse:
        if conn.closed or conn.transport.is_closing():
            # the worker reset or closed the connection before the request was written (it can
            # happen between connect and here): writing now raises on uvloop ("unable to perform
            # operation on <TCPTransport closed=True>") and is silently dropped by asyncio, where
            # the wait below would then last the whole timeout
            conn.closed = True
            conn.transport.abort()
            raise conn.error or UpstreamError("connection closed by the worker before the request was sent")
        waiter = conn.head_waiter = self.loop.create_future()
        timer = self.loop.call_later(timeout, self._on_timeout, conn, timeout)
        self._queue_write(conn, head + body)
        try:
            await waiter
        except BaseException:
            timer.cancel()
            conn.closed = True
            conn.transport.abort()
            raise
        conn.head_waiter = None
        return UpstreamResponse(conn, timer)

    @staticmethod
    def _on_timeout(conn: _Conn, timeout: float) -> None:
        if not conn.done:
            conn._fail(UpstreamTimeoutError(f"no complete answer within {timeout} s"))
            conn.closed = True
            conn.transport.abort()
