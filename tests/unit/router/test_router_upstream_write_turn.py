"""The upstream pool writes the requests read together at once, after the last of them is routed
(http/client.py, http/turn.py); the server counts the requests whose handlers have not started."""

import asyncio

import pytest
import uvloop

from fleetserve.router.http.client import UpstreamPool


async def counting_worker():
    """A keep-alive worker that answers every request ``{}`` and records each request's path."""
    paths: list[str] = []

    async def handle(reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                size = next(int(v) for k, _, v in (ln.partition(": ") for ln in lines[1:]) if k.lower() == "content-length")
                await reader.readexactly(size)
                paths.append(lines[0].split(" ")[1])
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    return srv, f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}", paths


async def answer(pool: UpstreamPool, base: str, path: str) -> bytes:
    resp = await pool.post(base, path, b"{}")
    try:
        return await resp.read()
    finally:
        resp.release()


def run(loop_kind: str, coro):
    return uvloop.run(coro) if loop_kind == "uvloop" else asyncio.run(coro)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_requests_of_one_turn_are_written_after_it_and_a_connection_closed_meanwhile_is_retried(loop_kind):
    run(loop_kind, one_turn_and_a_closed_connection())


async def one_turn_and_a_closed_connection():
    srv, base, paths = await counting_worker()
    pool = UpstreamPool(timeout_s=5)
    assert await asyncio.gather(answer(pool, base, "/w1"), answer(pool, base, "/w2")) == [b"{}", b"{}"]
    assert len(pool._idle[base]) == 2  # two keep-alive connections, both idle
    first_conn = pool._idle[base][-1]  # the one the next post takes
    pool.arrivals.waiting = 1  # another request read with these is still to be handled (its count stays)
    t1 = asyncio.ensure_future(answer(pool, base, "/a"))
    t2 = asyncio.ensure_future(answer(pool, base, "/b"))
    await asyncio.sleep(0)  # both ran to their wait for an answer in this turn: queued, not written yet
    assert not pool._idle.get(base) and [c for c, _ in pool._unsent] == [first_conn, pool._unsent[1][0]]
    first_conn.transport.close()  # the connection goes away before the turn ends
    assert await asyncio.wait_for(asyncio.gather(t1, t2), 5) == [b"{}", b"{}"]
    # "/a" was never written on the closed connection (else the worker would have seen it twice): it
    # went once, on a fresh connection, and "/b" on its own connection in the same turn
    assert sorted(paths) == ["/a", "/b", "/w1", "/w2"]
    assert not pool._unsent
    pool.close()
    srv.close()


@pytest.mark.timeout(20)
@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_many_requests_in_one_turn_all_reach_the_worker_once(loop_kind):
    run(loop_kind, many_in_one_turn())


async def many_in_one_turn():
    srv, base, paths = await counting_worker()
    pool = UpstreamPool(timeout_s=5)
    got = await asyncio.wait_for(asyncio.gather(*(answer(pool, base, f"/r{i}") for i in range(40))), 10)
    assert got == [b"{}"] * 40
    assert sorted(paths) == sorted(f"/r{i}" for i in range(40))
    # again on the 40 kept-alive connections, all queued in one turn
    got = await asyncio.wait_for(asyncio.gather(*(answer(pool, base, f"/s{i}") for i in range(40))), 10)
    assert got == [b"{}"] * 40 and len(paths) == 80 and len(pool._idle[base]) == 40
    pool.close()
    srv.close()


class _RaisingWrite:
    """A transport whose write raises (as uvloop's does on a transport closed under it); the rest is the real one."""

    def __init__(self, real, exc: BaseException) -> None:
        self.real, self.exc = real, exc

    def write(self, data: bytes) -> None:
        raise self.exc

    def __getattr__(self, name):
        return getattr(self.real, name)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
@pytest.mark.parametrize("exc", [RuntimeError("unable to perform operation"), ValueError("odd")])
def test_a_write_that_raises_fails_only_its_own_request(loop_kind, exc):
    async def scenario():
        srv, base, paths = await counting_worker()
        pool = UpstreamPool(timeout_s=5)
        assert await asyncio.gather(answer(pool, base, "/w1"), answer(pool, base, "/w2")) == [b"{}", b"{}"]
        broken = pool._idle[base][-1]  # the connection the next post takes
        broken.transport = _RaisingWrite(broken.transport, exc)
        pool.arrivals.waiting = 1  # written together at the end of the turn
        got = await asyncio.wait_for(asyncio.gather(answer(pool, base, "/a"), answer(pool, base, "/b")), 5)
        assert got == [b"{}", b"{}"]  # "/a" went again on a fresh connection (nothing had been sent)
        assert sorted(paths) == ["/a", "/b", "/w1", "/w2"] and broken.closed and not pool._unsent
        pool.close()
        srv.close()

    run(loop_kind, scenario())


@pytest.mark.timeout(20)
@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_a_request_alone_is_written_at_once_and_the_last_of_a_batch_writes_them_all(loop_kind):
    async def scenario():
        srv, base, paths = await counting_worker()
        pool = UpstreamPool(timeout_s=5)
        warm = await asyncio.gather(*(answer(pool, base, f"/w{i}") for i in range(3)))
        assert warm == [b"{}"] * 3 and len(pool._idle[base]) == 3  # three kept-alive connections
        t = asyncio.ensure_future(answer(pool, base, "/alone"))
        await asyncio.sleep(0)  # nothing else read with it: written in its own step, no turn waited
        assert not pool._unsent and not pool._write_scheduled
        assert await t == b"{}"

        async def handled_last(path):  # as the server does when this request's handler starts (turn.py)
            pool.arrivals.waiting -= 1
            return await answer(pool, base, path)

        pool.arrivals.waiting = 3  # three requests read together: their handlers start in this order
        tasks = [asyncio.ensure_future(handled_last(p)) for p in ("/a", "/b", "/c")]
        await asyncio.sleep(0)
        # "/a" and "/b" waited (and "/a" set the end-of-turn backstop, which has not run yet: it comes
        # after this step); "/c", handled last, wrote all three in its own step
        assert pool.arrivals.waiting == 0 and not pool._unsent
        assert await asyncio.wait_for(asyncio.gather(*tasks), 5) == [b"{}"] * 3
        assert sorted(paths) == ["/a", "/alone", "/b", "/c", "/w0", "/w1", "/w2"] and not pool._write_scheduled
        pool.close()
        srv.close()

    run(loop_kind, scenario())


@pytest.mark.timeout(30)
@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_the_server_count_of_requests_awaiting_their_handler_returns_to_zero(loop_kind):
    """Requests answered upstream, answered by the router itself (404, 413), pipelined on one connection,
    and connections closed by the client right after a request: the count ends at 0, and every answer
    that was owed arrived."""
    from fleetserve.router.http.server import Response, Routes, start_server

    async def scenario():
        wsrv, base, paths = await counting_worker()
        pool = UpstreamPool(timeout_s=5)
        seen = []

        async def forward(req):
            seen.append(pool.arrivals.waiting)
            resp = await pool.post(base, req.path, req.body)
            try:
                return Response(200, await resp.read())
            finally:
                resp.release()

        routes = Routes()
        routes.add("POST", "/up", forward)
        srv = await start_server(routes, "127.0.0.1", 0, 1000, arrivals=pool.arrivals)
        port = srv.sockets[0].getsockname()[1]

        async def one(raw: bytes, answers: int, close_early: bool = False) -> list[bytes]:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(raw)
            if close_early:
                writer.close()
                return []
            got = []
            for _ in range(answers):
                head = await reader.readuntil(b"\r\n\r\n")
                size = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
                got.append(head.split(b" ")[1] + b" " + await reader.readexactly(size))
            writer.close()
            return got

        post = b"POST /up HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"
        missing = b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n"
        big = b"POST /up HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n" + b"x" * 5000
        for _ in range(3):
            got = await asyncio.wait_for(asyncio.gather(
                *(one(post, 1) for _ in range(20)), one(post * 3, 3), one(missing, 1), one(big, 1),
                *(one(post, 0, close_early=True) for _ in range(5))), 10)
            assert got[:21] == [[b"200 {}"]] * 20 + [[b"200 {}"] * 3]
            assert got[21][0].startswith(b"404 ") and got[22][0].startswith(b"413 ")
            for _ in range(50):  # the early-closed connections' handlers are cancelled or run out
                if pool.arrivals.waiting == 0:
                    break
                await asyncio.sleep(0.01)
            assert pool.arrivals.waiting == 0
        assert max(seen) > 0  # requests of one batch did see others still waiting for their handlers
        srv.close()
        pool.close()
        wsrv.close()

    run(loop_kind, scenario())


class _Transport:
    """Just enough of a transport for HttpProtocol to take a request (nothing is sent anywhere)."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def close(self) -> None:
        self.closing = True

    def is_closing(self) -> bool:
        return self.closing

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_extra_info(self, name, default=None):
        return default


@pytest.mark.timeout(20)
@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_a_request_whose_connection_is_lost_before_its_handler_starts_is_uncounted(loop_kind):
    from fleetserve.router.http.server import HttpProtocol, Response, Routes
    from fleetserve.router.http.turn import Arrivals

    async def scenario():
        calls = []

        async def handler(req):
            calls.append(req.path)
            return Response(200, b"{}")

        routes = Routes()
        routes.add("POST", "/up", handler)
        arrivals = Arrivals()
        post = b"POST /up HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"
        lost, kept = HttpProtocol(routes.table, 1000, None, (), arrivals), HttpProtocol(routes.table, 1000, None, (), arrivals)
        for proto in (lost, kept):
            proto.connection_made(_Transport())
            proto.data_received(post)
        assert arrivals.waiting == 2  # both read, neither handler started
        lost.connection_lost(None)  # its task is cancelled before its first step: its body never runs
        assert arrivals.waiting == 1
        await asyncio.sleep(0.05)
        assert arrivals.waiting == 0 and calls == ["/up"]  # the kept one ran and was uncounted as it started
        assert kept.transport.written and kept.transport.written[0].startswith(b"HTTP/1.1 200")
        kept.data_received(post * 2)  # pipelined on a connection whose task has ended: counted once, as one task
        assert arrivals.waiting == 1
        await asyncio.sleep(0.05)
        assert arrivals.waiting == 0 and calls == ["/up"] * 3
        lost.connection_lost(None)  # a second loss changes nothing
        assert arrivals.waiting == 0

    run(loop_kind, scenario())
