"""bench client: a request whose try failed before any byte of a response is sent again (and
counted); one that failed after the status line is not, and failures are never hidden.

A raw asyncio TCP server on port 0 plays the server: per connection it either closes at once
after reading the request (nothing answered) or answers with an SSE stream of 3 chunks, or sends
the status line and then closes mid-stream, following a script.
"""

import asyncio
import json

from fleetserve.bench.client import run_requests
from fleetserve.bench.workloads import BenchRequest


def _sse_reply() -> bytes:
    body = b""
    for i in range(3):
        body += b"data: " + json.dumps({"choices": [{"index": 0, "text": f" t{i}"}]}).encode() + b"\n\n"
    usage = {"prompt_tokens": 4, "completion_tokens": 3}
    body += b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\ndata: [DONE]\n\n"
    return (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


async def _serve(script: list[str]):
    """Start the scripted server; returns (server, base URL, list of actions taken)."""
    taken: list[str] = []

    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        action = script[len(taken)] if len(taken) < len(script) else "answer"
        taken.append(action)
        if action == "answer" or action == "half":
            length = int([ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")][0])
            await asyncio.wait_for(reader.readexactly(length), 10)
            reply = _sse_reply()
            writer.write(reply if action == "answer" else reply[: reply.index(b"\r\n\r\n") + 4 + 20])
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}", taken


def _drive(script: list[str], retries: int):
    async def go():
        server, base, taken = await _serve(script)
        try:
            req = BenchRequest(rid="r0", messages=[{"role": "user", "content": "hi"}], prompt_len=1, output_len=3,
                               group="g")
            res, _ = await asyncio.wait_for(run_requests(base, [req], api="completions", progress=False,
                                                         timeout_s=30, retries=retries), 60)
            return res[0], taken
        finally:
            server.close()
            await server.wait_closed()
    return asyncio.run(go())


def test_unanswered_try_is_retried_and_counted():
    r, taken = _drive(["drop", "drop", "answer"], retries=2)
    assert taken == ["drop", "drop", "answer"]
    assert r.success and r.retries == 2 and r.completion_tokens == 3 and r.text == " t0 t1 t2"
    assert "retries" in r.to_dict() and "unanswered" not in r.to_dict()


def test_retries_run_out_and_the_failure_shows():
    r, taken = _drive(["drop", "drop", "drop"], retries=1)
    assert taken == ["drop", "drop"]
    assert not r.success and r.retries == 1 and r.status == 0 and r.error


def test_no_retry_by_default_nor_after_the_status_line():
    r, taken = _drive(["drop"], retries=0)
    assert taken == ["drop"] and not r.success and r.retries == 0
    r, taken = _drive(["half", "answer"], retries=3)
    assert taken == ["half"]  # the status line came back: never sent again
    assert not r.success and r.status == 200 and r.retries == 0
