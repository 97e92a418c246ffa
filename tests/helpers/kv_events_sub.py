"""A test subscriber to a KV-event publisher: its own ZMQ context, real sockets, every wait bounded."""

from __future__ import annotations

import time

import msgpack
import zmq

END_SEQ = b"\xff" * 8


def free_port_block(n: int) -> int:
    """A port p with p .. p + n - 1 all free a moment ago (for per-DP-rank ports)."""
    import socket

    from fleetserve.engine.rank_supervisor import free_port

    for _ in range(50):
        p = free_port()
        socks = []
        try:
            for k in range(n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p + k))
            return p
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise AssertionError("no block of free ports")


class Subscriber:
    """SUB socket connected to ``endpoint``, subscribed to ``topic`` (bytes prefix)."""

    def __init__(self, endpoint: str, topic: bytes = b"", rcvhwm: int | None = None):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        if rcvhwm is not None:
            self.sock.setsockopt(zmq.RCVHWM, rcvhwm)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self.sock.connect(endpoint)

    def recv(self, timeout_s: float = 5.0) -> list[bytes] | None:
        """The next message's frames, or ``None`` after ``timeout_s``."""
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        return self.sock.recv_multipart()

    def drain(self, quiet_s: float = 0.3) -> list[list[bytes]]:
        """Every message until none arrives for ``quiet_s``."""
        out = []
        while (m := self.recv(quiet_s)) is not None:
            out.append(m)
        return out

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def seq_of(frames: list[bytes]) -> int:
    return int.from_bytes(frames[1], "big")


def batch_of(frames: list[bytes]):
    return msgpack.unpackb(frames[2])


def wait_connected(pub, *subs: Subscriber, timeout_s: float = 20.0) -> int:
    """Publish ``AllBlocksCleared`` batches until every ``sub`` has one (ZMQ's slow joiner), then drain.

    Returns the sequence number the next batch will get.
    """
    deadline = time.monotonic() + timeout_s
    pending = set(range(len(subs)))
    while pending:
        assert time.monotonic() < deadline, "subscriber never connected"
        pub.all_blocks_cleared()
        pub.end_step()
        for i in list(pending):
            if subs[i].recv(0.05) is not None:
                pending.discard(i)
    while pub.published < pub.next_seq:  # let the warm-up batches leave, then drop them
        assert time.monotonic() < deadline, "publisher thread stuck"
        time.sleep(0.01)
    for s in subs:
        s.drain(0.2)
    return pub.next_seq


def replay(endpoint: str, start_seq: int, timeout_s: float = 5.0) -> list[list[bytes]]:
    """Ask the replay ROUTER with a DEALER ``[b"", start_seq]``; every answer message up to and
    including the end marker (each ``[b"", seq, payload]``)."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    try:
        s.connect(endpoint)
        s.send_multipart([b"", start_seq.to_bytes(8, "big")])
        out = []
        while True:
            assert s.poll(int(timeout_s * 1000)), f"replay answered {len(out)} messages, then nothing"
            m = s.recv_multipart()
            out.append(m)
            if m[1] == END_SEQ:
                return out
    finally:
        s.close(0)
        ctx.term()
