"""The router's lean HTTP/1.1 server and upstream client, in-process over loopback sockets."""

import asyncio

import pytest

from fleetserve.router.http.server import Response, Routes, start_server
from fleetserve.router.http.client import UpstreamError, UpstreamPool, UpstreamTimeoutError


async def echo(req):
    return Response(200, b'{"path":"%s","n":%d}' % (req.path.encode(), len(req.body)))


async def stream(req):
    req.start_stream(200, "text/event-stream")
    for i in range(3):
        await req.write(b"data: %d\n\n" % i)
    req.end_stream()


async def slow(req):
    await asyncio.sleep(5)
    return Response(200, b"{}")


async def empty(req):
    return Response(204)


async def serve(max_body=100, idle_timeout_s=75.0):
    routes = Routes()
    routes.add("POST", "/echo", echo)
    routes.add("POST", "/stream", stream)
    routes.add("POST", "/slow", slow)
    routes.add("POST", "/empty", empty)
    srv = await start_server(routes, "127.0.0.1", 0, max_body, idle_timeout_s=idle_timeout_s)
    return srv, srv.sockets[0].getsockname()[1]


async def exchange(port, raw: bytes, until: bytes = b"", n_responses: int = 1) -> bytes:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(raw)
    data = b""
    while data.count(b"HTTP/1.1 ") < n_responses or (until and until not in data):
        chunk = await asyncio.wait_for(r.read(65536), 5)
        if not chunk:
            break
        data += chunk
    w.close()
    return data


@pytest.mark.timeout(20)
async def test_pipelined_requests_answer_in_order_and_errors_are_json():
    srv, port = await serve()
    req = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc"
    two = await exchange(port, req + req.replace(b"abc", b"abcd").replace(b"3", b"4"), n_responses=2)
    assert two.count(b"HTTP/1.1 200 OK") == 2
    assert two.index(b'"n":3') < two.index(b'"n":4')
    assert b"404 Not Found" in await exchange(port, b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n")
    assert b"405 Method Not Allowed" in await exchange(port, b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
    bad = await exchange(port, b"NOT HTTP AT ALL\r\n\r\n")
    assert bad.startswith(b"HTTP/1.1 400") and b'"code":null' in bad
    srv.close()


@pytest.mark.timeout(20)
async def test_413_expect_continue_and_chunked_stream():
    srv, port = await serve(max_body=100)
    big = await exchange(port, b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n" + b"x" * 500)
    assert big.startswith(b"HTTP/1.1 413") and b"Connection: close" in big
    cont = await exchange(port, b"POST /echo HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 2\r\n"
                                b"\r\nhi", n_responses=2)
    assert cont.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK") and b'"n":2' in cont
    s = await exchange(port, b"POST /stream HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", until=b"0\r\n\r\n")
    assert b"Transfer-Encoding: chunked" in s and b"9\r\ndata: 0\n\n\r\n" in s and s.endswith(b"0\r\n\r\n")
    srv.close()


@pytest.mark.timeout(20)
async def test_upstream_pool_reuses_connections_streams_and_times_out():
    srv, port = await serve(max_body=10_000)
    pool = UpstreamPool(timeout_s=5)
    base = f"http://127.0.0.1:{port}"
    for n in (1, 2, 3):
        resp = await pool.post(base, "/echo", b"x" * n)
        assert resp.status == 200 and await resp.read() == b'{"path":"/echo","n":%d}' % n
        resp.release()
    assert len(pool._idle[base]) == 1  # one keep-alive connection served all three
    resp = await pool.post(base, "/stream", b"")
    chunks = []
    while chunk := await resp.next_chunk():
        chunks.append(chunk)
    resp.release()
    assert b"".join(chunks) == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
    with pytest.raises(UpstreamTimeoutError):
        r = await pool.post(base, "/slow", b"", timeout_s=0.2)
        await r.read()
    with pytest.raises(UpstreamError):
        await pool.post("http://127.0.0.1:9", "/echo", b"")  # nothing listens on the discard port
    pool.close()
    srv.close()


@pytest.mark.timeout(20)
async def test_upstream_reconnects_when_the_worker_dropped_an_idle_connection():
    conns = []

    async def handle(reader, writer):
        conns.append(writer)
        await reader.readuntil(b"\r\n\r\n")
        # answer as keep-alive, then drop the connection anyway (an idle timeout on the worker side)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    base = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
    pool = UpstreamPool(timeout_s=5)
    for _ in range(3):
        resp = await pool.post(base, "/x", b"{}")
        assert resp.status == 200 and await resp.read() == b"{}"
        resp.release()
        await asyncio.sleep(0.2)  # the worker closes the idle connection meanwhile
    assert len(conns) == 3  # each request found its idle connection dead and opened a new one
    pool.close()
    srv.close()


@pytest.mark.timeout(20)
async def test_idle_client_connections_are_closed():
    srv, port = await serve(idle_timeout_s=0.3)
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\na")
    assert (await asyncio.wait_for(r.readuntil(b'"n":1}'), 5)).startswith(b"HTTP/1.1 200")
    assert await asyncio.wait_for(r.read(), 5) == b""  # the server closed the idle connection
    w.close()
    srv.close()


@pytest.mark.timeout(20)
async def test_upstream_reads_a_whole_body_larger_than_the_stream_buffer():
    """A non-streamed answer of several MiB: reading pauses at 1 MiB buffered for streams, and a
    whole-body read must resume it (it used to wait for the request timeout instead)."""
    big = b"[" + b",".join(b'"%06d"' % i for i in range(400_000)) + b"]"  # ~3.6 MB

    async def handle(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(big))
        writer.write(big)
        await writer.drain()
        await reader.readuntil(b"\r\n\r\n")  # the pooled connection carries a second request
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
        await writer.drain()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    base = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
    pool = UpstreamPool(timeout_s=5)
    resp = await pool.post(base, "/x", b"{}")
    assert resp.status == 200 and await resp.read() == big
    resp.release()
    resp = await pool.post(base, "/x", b"{}")  # same connection, reading not left paused
    assert await resp.read() == b"{}"
    resp.release()
    pool.close()
    srv.close()


async def _raw_worker(answers):
    """A worker on loopback that answers the n-th request on each connection with ``answers[n]`` (raw bytes,
    or a list of (delay_s, bytes) pieces); returns (server, base url, list of connections seen)."""
    conns = []

    async def handle(reader, writer):
        conns.append(writer)
        for answer in answers:
            try:
                await reader.readuntil(b"\r\n\r\n")
                await reader.readexactly(2)  # the test bodies are b"{}"
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            for delay, piece in answer if isinstance(answer, list) else [(0, answer)]:
                await asyncio.sleep(delay)
                writer.write(piece)
            await writer.drain()
        await asyncio.sleep(5)

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    return srv, f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}", conns


def _ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n%s" % (len(body), extra, body)


@pytest.mark.timeout(20)
async def test_upstream_skips_interim_1xx_responses():
    srv, base, conns = await _raw_worker([
        [(0, b"HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n"), (0.1, _ok(b'{"a":1}', b"X-W: 1\r\n"))],
        b"HTTP/1.1 100 Continue\r\n\r\n" + _ok(b'{"b":2}')])
    pool = UpstreamPool(timeout_s=5)
    resp = await pool.post(base, "/x", b"{}")
    assert resp.status == 200 and resp.headers == {"content-length": "7", "x-w": "1"}
    assert await resp.read() == b'{"a":1}'
    resp.release()
    resp = await pool.post(base, "/x", b"{}")
    assert resp.status == 200 and await resp.read() == b'{"b":2}'
    resp.release()
    assert len(conns) == 1
    pool.close()
    srv.close()


@pytest.mark.timeout(20)
async def test_upstream_never_hands_a_second_unasked_answer_to_the_next_request():
    # worker A answers, then sends another response later (to the idle pooled connection);
    # worker B answers with two responses in one packet
    late = _ok(b'{"SECRET":1}')
    for first in ([(0, _ok(b'{"mine":1}')), (0.1, late)], _ok(b'{"mine":1}') + late):
        srv, base, conns = await _raw_worker([first, _ok(b'{"mine":2}')])
        pool = UpstreamPool(timeout_s=5)
        resp = await pool.post(base, "/x", b"{}")
        assert await resp.read() == b'{"mine":1}'
        resp.release()
        await asyncio.sleep(0.3)
        resp = await pool.post(base, "/x", b"{}")
        body = await resp.read()
        resp.release()
        assert b"SECRET" not in body
        assert len(conns) == 2  # the connection that carried the extra answer was not reused
        pool.close()
        srv.close()


@pytest.mark.timeout(20)
async def test_upstream_keeps_repeated_headers():
    srv, base, _ = await _raw_worker([_ok(b"{}", b"Set-Cookie: a=1\r\nSet-Cookie: b=2\r\nX-Dup: one\r\nx-dup: two\r\n")])
    pool = UpstreamPool(timeout_s=5)
    resp = await pool.post(base, "/x", b"{}")
    await resp.read()
    assert resp.headers["x-dup"] == "one, two"
    assert [p for p in resp.header_pairs if p[0] in ("set-cookie", "x-dup")] == [
        ("set-cookie", "a=1"), ("set-cookie", "b=2"), ("x-dup", "one"), ("x-dup", "two")]
    resp.release()
    pool.close()
    srv.close()


async def _read_all(port, raw: bytes, timeout: float = 5) -> bytes:
    """Send ``raw`` and read until the server closes the connection."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(raw)
    data = b""
    while chunk := await asyncio.wait_for(r.read(65536), timeout):
        data += chunk
    w.close()
    return data


@pytest.mark.timeout(20)
async def test_oversized_target_headers_and_announced_body_are_refused_early():
    from fleetserve.router.http.server import MAX_HEAD_BYTES, MAX_URL_BYTES

    srv, port = await serve(max_body=100)
    long_url = await _read_all(port, b"GET /" + b"a" * (MAX_URL_BYTES + 10) + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    assert long_url.startswith(b"HTTP/1.1 414") and b'"code":null' in long_url
    big_head = await _read_all(port, b"GET /health HTTP/1.1\r\nX-Big: " + b"h" * MAX_HEAD_BYTES + b"\r\n\r\n")
    assert big_head.startswith(b"HTTP/1.1 431")
    # a client that announces too big a body and waits for 100 Continue gets the 413 without sending it
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 5000000\r\n\r\n")
    early = await asyncio.wait_for(r.read(65536), 2)
    assert early.startswith(b"HTTP/1.1 413") and b"Connection: close" in early
    w.close()
    # without Expect the 413 also goes out before the body is complete
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n" + b"x" * 100)
    assert (await asyncio.wait_for(r.read(65536), 2)).startswith(b"HTTP/1.1 413")
    w.close()
    srv.close()


@pytest.mark.timeout(20)
async def test_errors_and_100_continue_wait_for_answers_already_owed():
    srv, port = await serve()
    # a slow request, then garbage on the same connection: the slow one is still answered, first
    two = await _read_all(port, b"POST /slow HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\nGARBAGE\r\n\r\n",
                          timeout=10)
    assert two.startswith(b"HTTP/1.1 200 OK") and two.count(b"HTTP/1.1 ") == 2 and b"HTTP/1.1 400" in two
    # Expect: 100-continue on a pipelined second request does not overtake the first answer
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(b"POST /slow HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"
            b"POST /echo HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n")
    await asyncio.sleep(0.3)
    w.write(b"hi")
    data = b""
    while data.count(b"HTTP/1.1 200") < 2:
        data += await asyncio.wait_for(r.read(65536), 10)
    assert data.startswith(b"HTTP/1.1 200 OK") and b"100 Continue" not in data and b'"n":2' in data
    w.close()
    srv.close()


@pytest.mark.timeout(20)
async def test_absolute_form_target_204_and_a_stalled_request():
    srv, port = await serve(idle_timeout_s=0.4)
    absolute = await exchange(port, b"POST http://x/echo?a=1 HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\na")
    assert absolute.startswith(b"HTTP/1.1 200") and b'"path":"/echo"' in absolute
    empty = await exchange(port, b"POST /empty HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    assert empty.startswith(b"HTTP/1.1 204") and b"Content-Length" not in empty
    # slowloris: headers never finished -> 408 and closed after the idle timeout
    stalled = await _read_all(port, b"POST /echo HTTP/1.1\r\nHost: x\r\n")
    assert stalled.startswith(b"HTTP/1.1 408")
    srv.close()


@pytest.mark.timeout(30)
async def test_pipelined_flood_is_throttled_not_buffered():
    srv, port = await serve()
    _, w = await asyncio.open_connection("127.0.0.1", port)
    one = b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n"
    w.write(b"POST /slow HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n" + one * 50_000)  # 1.3 MB
    await asyncio.sleep(1.0)
    (proto,) = srv.live
    # reading stopped once the queue was full: what was parsed is bounded by one socket read,
    # not by what the client sends (it used to parse and queue all 50,000)
    assert proto._reading_paused and len(proto._queue) < 50_000 // 4
    w.close()
    srv.close()


@pytest.mark.timeout(20)
async def test_a_413_client_that_never_sends_its_body_is_closed_without_a_second_answer():
    srv, port = await serve(idle_timeout_s=0.4)
    data = await _read_all(port, b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n" + b"x" * 10)
    assert data.startswith(b"HTTP/1.1 413") and data.count(b"HTTP/1.1 ") == 1
    srv.close()


@pytest.mark.timeout(20)
async def test_upstream_drops_chunked_trailers():
    chunked = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-Head: 1\r\n\r\n"
               b"2\r\n{}\r\n0\r\nX-Trailer: 1\r\n\r\n")
    srv, base, _ = await _raw_worker([chunked])
    pool = UpstreamPool(timeout_s=5)
    resp = await pool.post(base, "/x", b"{}")
    assert await resp.read() == b"{}"
    assert "x-trailer" not in resp.headers and ("x-head", "1") in resp.header_pairs
    assert all(k != "x-trailer" for k, _ in resp.header_pairs)
    resp.release()
    pool.close()
    srv.close()


def test_a_late_request_is_answered_at_most_a_second_past_the_timeout():
    """The slow-client pass runs every second at the default 75 s (docs/router.md: 408 by 76 s;
    a quarter of the timeout before, so up to 94 s), and a quarter of a short timeout."""
    from fleetserve.router.http.server import idle_check_interval

    assert idle_check_interval(75.0) == 1.0
    assert idle_check_interval(0.4) == 0.1 and idle_check_interval(0.01) == 0.05


@pytest.mark.timeout(20)
async def test_405_names_the_allowed_methods_in_allow():
    """RFC 9110 15.5.6: a 405 carries ``Allow`` with the methods the path takes (exact and prefix routes)."""
    routes = Routes()
    routes.add("POST", "/echo", echo)
    routes.add("GET", "/both", echo)
    routes.add("POST", "/both", echo)
    routes.add_prefix("GET", "/items/", echo)
    routes.add_prefix("DELETE", "/items/", echo)
    srv = await start_server(routes, "127.0.0.1", 0, 100)
    port = srv.sockets[0].getsockname()[1]
    try:
        one = await exchange(port, b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
        head, _, body = one.partition(b"\r\n\r\n")
        assert head.split(b"\r\n")[0] == b"HTTP/1.1 405 Method Not Allowed"
        assert b"\r\nAllow: POST\r\n" in head + b"\r\n"
        assert body == (b'{"error":{"message":"GET is not allowed on /echo","type":"invalid_request_error",'
                        b'"param":null,"code":null}}')
        two = await exchange(port, b"DELETE /both HTTP/1.1\r\nHost: x\r\n\r\n")
        assert two.startswith(b"HTTP/1.1 405 ") and b"\r\nAllow: GET, HEAD, POST\r\n" in two
        pre = await exchange(port, b"PUT /items/a HTTP/1.1\r\nHost: x\r\n\r\n")
        assert pre.startswith(b"HTTP/1.1 405 ") and b"\r\nAllow: DELETE, GET, HEAD\r\n" in pre
        ok = await exchange(port, b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        assert ok.startswith(b"HTTP/1.1 200 ") and b"Allow:" not in ok
        # HEAD is GET without the body (RFC 9110 9.3.2): the GET answer's headers, then the next answer at once
        got = await exchange(port, b"HEAD /items/a HTTP/1.1\r\nHost: x\r\n\r\nGET /items/a HTTP/1.1\r\nHost: x"
                                   b"\r\n\r\n", n_responses=2, until=b"}")
        head_answer, get_answer = got.split(b"HTTP/1.1 ")[1:]
        want = b'{"path":"/items/a","n":0}'
        assert head_answer.startswith(b"200 ") and head_answer.endswith(b"Content-Length: %d\r\n\r\n" % len(want))
        assert get_answer.startswith(b"200 ") and get_answer.endswith(b"\r\n\r\n" + want)
        # no GET there: still 405, and a 404 elsewhere, both without a body (a HEAD answer never has one)
        nope = await exchange(port, b"HEAD /echo HTTP/1.1\r\nHost: x\r\n\r\nHEAD /none HTTP/1.1\r\nHost: x\r\n\r\n"
                                    b"GET /items/b HTTP/1.1\r\nHost: x\r\n\r\n", n_responses=3, until=b"}")
        a405, a404, a200 = nope.split(b"HTTP/1.1 ")[1:]
        assert a405.startswith(b"405 ") and b"\r\nAllow: POST\r\n" in a405 and a405.endswith(b"\r\n\r\n")
        assert a404.startswith(b"404 ") and a404.endswith(b"\r\n\r\n")
        assert a200.endswith(b'{"path":"/items/b","n":0}')
    finally:
        srv.close()
