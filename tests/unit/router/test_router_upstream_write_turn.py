"""The upstream pool writes the requests queued in one event-loop turn after that turn (http/client.py)."""

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
        got = await asyncio.wait_for(asyncio.gather(answer(pool, base, "/a"), answer(pool, base, "/b")), 5)
        assert got == [b"{}", b"{}"]  # "/a" went again on a fresh connection (nothing had been sent)
        assert sorted(paths) == ["/a", "/b", "/w1", "/w2"] and broken.closed and not pool._unsent
        pool.close()
        srv.close()

    run(loop_kind, scenario())
