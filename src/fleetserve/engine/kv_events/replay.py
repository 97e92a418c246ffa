"""Replay of recent batches over a ZMQ ROUTER socket (vLLM's and SGLang's protocol).

A subscriber that sees a gap in the sequence numbers asks the replay socket
for everything from some sequence number on. Frames, as the ROUTER sees them:

* request: ``[identity, b"", start_seq]`` - a DEALER sends ``[b"", start_seq]``, a
  REQ socket just ``start_seq`` (it adds the empty delimiter); ``start_seq``
  is an unsigned big-endian integer, 8 bytes in practice;
* answer, one message per buffered batch with ``seq >= start_seq``, oldest
  first: ``[identity, b"", seq (8 bytes big-endian), payload]``, then the end
  marker ``[identity, b"", (-1).to_bytes(8, "big", signed=True), b""]``
  (``ff`` x 8 and an empty payload).

A request with another frame count is logged and ignored (vLLM does the
same). Only published batches are buffered: a batch dropped before it was
encoded (queue overflow) cannot be replayed and leaves its gap.

A REQ client reads only the first answer message of each request; use a
DEALER to read them all.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator

import zmq

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def seq_bytes(seq: int) -> bytes:
    """``seq`` as the 8-byte big-endian frame of the live stream and of replay answers."""
    return seq.to_bytes(8, "big")


class ReplayBuffer:
    """The last ``capacity`` published batches as ``(seq, payload)``, oldest first."""

    def __init__(self, capacity: int):
        self._items: deque[tuple[int, bytes]] = deque(maxlen=max(0, capacity))

    def append(self, seq: int, payload: bytes) -> None:
        if self._items.maxlen:
            self._items.append((seq, payload))

    def since(self, start_seq: int) -> Iterator[tuple[int, bytes]]:
        """Buffered batches with ``seq >= start_seq``."""
        return ((s, p) for s, p in self._items if s >= start_seq)

    def __len__(self) -> int:
        return len(self._items)


def serve_replay_request(sock: zmq.Socket, buffer: ReplayBuffer) -> bool:
    """Answer one waiting request on ROUTER ``sock`` (call when it polls readable).

    Never blocks: a ROUTER drops messages to a peer that is gone or whose
    queue is full (its send high-water mark), so a stalled client costs only
    the messages it misses.

    Returns:
        ``True`` when a request was answered, ``False`` for none or a malformed one.
    """
    try:
        frames = sock.recv_multipart(zmq.NOBLOCK)
    except zmq.Again:
        return False
    if len(frames) != 3 or frames[1] != b"":
        logger.warning("kv-events replay: ignored a request of %d frames", len(frames))
        return False
    ident, _, start = frames
    start_seq = int.from_bytes(start, "big")
    try:
        for seq, payload in buffer.since(start_seq):
            sock.send_multipart((ident, b"", seq_bytes(seq), payload), zmq.NOBLOCK)
        sock.send_multipart((ident, b"", END_SEQ, b""), zmq.NOBLOCK)
    except zmq.Again:  # only with ROUTER_MANDATORY; we do not set it
        logger.warning("kv-events replay: client queue full, answer cut short")
    return True
