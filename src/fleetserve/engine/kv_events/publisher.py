"""The KV-event publisher of one DP rank: a :class:`~fleetserve.engine.kv_event_sink.KVEventSink`
that sends one batch per scheduler step over ZMQ.

Wire (vLLM's ``ZmqEventPublisher``, SGLang's copy of it): every message on the
PUB socket has three frames::

    [topic (utf-8), seq (8 bytes big-endian, 0, 1, 2, ...), payload (msgpack, see events.py)]

Threads: the radix cache calls :meth:`block_stored` / :meth:`block_removed` /
:meth:`all_blocks_cleared` on the scheduler thread, which only appends to a
list; :meth:`end_step` (once per step) turns the list into one batch, gives it
the next sequence number and puts it in a bounded queue without waiting. A
daemon thread takes batches from the queue, encodes them, sends them and
keeps them for replay, and answers replay requests; it alone uses the
sockets after start-up. When the queue is full the batch is dropped and
counted (:attr:`dropped`), and its sequence number is still used, so
subscribers see the gap. PUB and ROUTER sockets drop rather than block when
a subscriber is slow, stalled or gone, so nothing a subscriber does reaches
the scheduler.

Port per DP rank: ``endpoint`` and ``replay_endpoint`` are offset by the port
offset (the DP rank; see :func:`~fleetserve.engine.kv_events.config.offset_endpoint`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import zmq

from fleetserve.engine.kv_events.config import FLAG, KVEventsConfig, binds, offset_endpoint
from fleetserve.engine.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, encode_batch
from fleetserve.engine.kv_events.replay import ReplayBuffer, seq_bytes, serve_replay_request

logger = logging.getLogger(__name__)

POLL_S = 0.01  # how often an idle thread with a replay socket looks at it
IDLE_S = 0.5  # how often an idle thread without one looks at the stop flag
SHUTDOWN_S = 2.0


class KVEventPublisher:
    """Publishes this rank's KV-cache events (see the module docstring).

    Args:
        config: a checked :class:`KVEventsConfig` with ``publisher == "zmq"``.
        data_parallel_rank: written into every batch.
        port_offset: added to the endpoints' ports; default ``data_parallel_rank``.
        autostart: start the publisher thread now (tests start it later with :meth:`start`).

    Attributes:
        endpoint, replay_endpoint: this rank's addresses (after the offset).
        published: batches sent so far; dropped: batches lost to a full queue;
        next_seq: the sequence number the next batch gets.

    Raises:
        ValueError: ``--kv-events-config: endpoint ...`` (or ``replay_endpoint``)
            when ZMQ cannot bind or connect there (busy port, bad address).
    """

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0, port_offset: int | None = None,
                 autostart: bool = True):
        self.config = config
        self.data_parallel_rank = int(data_parallel_rank)
        offset = self.data_parallel_rank if port_offset is None else int(port_offset)
        self.endpoint = offset_endpoint(config.endpoint, offset)
        self.replay_endpoint = (None if config.replay_endpoint is None
                                else offset_endpoint(config.replay_endpoint, offset))
        self._topic = config.topic.encode("utf-8")
        self._encoding = config.encoding
        self._ctx = zmq.Context()
        self._pub: zmq.Socket | None = None
        self._replay: zmq.Socket | None = None
        try:
            self._pub = self._open(zmq.PUB, "endpoint", self.endpoint, binds(self.endpoint))
            if self.replay_endpoint is not None:  # vLLM and SGLang always bind the replay ROUTER
                self._replay = self._open(zmq.ROUTER, "replay_endpoint", self.replay_endpoint, True)
        except ValueError:
            self._close_sockets()
            raise
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer = ReplayBuffer(config.buffer_steps)
        self._pending: list[KVEvent] = []
        self.next_seq = 0
        self.published = 0
        self.dropped = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-events-dp{self.data_parallel_rank}", daemon=True)
        self._started = False
        self._closed = False
        if autostart:
            self.start()

    def _open(self, kind: int, key: str, endpoint: str, bind: bool) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self.config.hwm)
        try:
            if bind:
                sock.bind(endpoint)
            else:
                sock.connect(endpoint)
        except zmq.ZMQError as e:
            sock.close(0)
            verb = "bind" if bind else "connect"
            raise ValueError(f"{FLAG}: {key} {endpoint!r}: cannot {verb} ({zmq.strerror(e.errno)})") from None
        return sock

    # ------------------------------------------------------------------ sink
    def block_stored(self, block_hashes: list[int], parent_block_hash: int | None, token_ids: list[int],
                     block_size: int) -> None:
        self._pending.append(BlockStored(list(block_hashes), parent_block_hash, list(token_ids), int(block_size)))

    def block_removed(self, block_hashes: list[int]) -> None:
        self._pending.append(BlockRemoved(list(block_hashes)))

    def all_blocks_cleared(self) -> None:
        self._pending.append(AllBlocksCleared())

    # ------------------------------------------------------------------ steps
    def end_step(self) -> int | None:
        """Queue this step's events as one batch; returns its sequence number (``None``: no events).

        Never waits: with the queue full the batch is dropped and counted, and
        its sequence number is spent all the same.
        """
        if self._closed:
            self._pending = []
            return None
        if not self._pending:
            return None
        events, self._pending = self._pending, []
        seq = self.next_seq
        self.next_seq += 1
        try:
            self._queue.put_nowait((seq, time.time(), events))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                logger.warning("kv-events: queue full (%d batches), %d batch(es) dropped so far",
                               self.config.max_queue_size, self.dropped)
        return seq

    flush = end_step

    def stats(self) -> dict[str, int]:
        """``{"published", "dropped", "queued", "next_seq"}`` (batches)."""
        return {"published": self.published, "dropped": self.dropped, "queued": self._queue.qsize(),
                "next_seq": self.next_seq}

    # ----------------------------------------------------------------- thread
    def start(self) -> None:
        """Start the publisher thread (once)."""
        if not self._started:
            self._started = True
            self._thread.start()

    def _run(self) -> None:
        wait = POLL_S if self._replay is not None else IDLE_S
        try:
            while True:
                if self._replay is not None and self._replay.poll(0):
                    serve_replay_request(self._replay, self._buffer)
                try:
                    item = self._queue.get(timeout=wait)
                except queue.Empty:
                    if self._stop.is_set():
                        return
                    continue
                if item is None:
                    return
                self._send(*item)
        except Exception:  # never take the scheduler down; the counters tell what was published
            logger.exception("kv-events publisher thread failed")

    def _send(self, seq: int, ts: float, events: list[KVEvent]) -> None:
        payload = encode_batch(ts, events, self.data_parallel_rank, self._encoding)
        self._pub.send_multipart((self._topic, seq_bytes(seq), payload), copy=False)
        self._buffer.append(seq, payload)
        self.published += 1

    # --------------------------------------------------------------- shutdown
    def shutdown(self, timeout: float = SHUTDOWN_S) -> None:
        """Send what is queued (up to ``timeout`` seconds), stop the thread, close the sockets (linger 0)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._started:
            try:
                self._queue.put_nowait(None)
            except queue.Full:  # the thread drains the queue, then sees the stop flag
                pass
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("kv-events publisher thread did not stop within %.1f s", timeout)
                return  # its sockets stay open; the daemon thread ends with the process
        self._close_sockets()

    def _close_sockets(self) -> None:
        for s in (self._pub, self._replay):
            if s is not None:
                s.close(0)
        self._ctx.term()

    close = shutdown


def make_publisher(config: KVEventsConfig | None, data_parallel_rank: int = 0,
                   port_offset: int | None = None) -> KVEventPublisher | None:
    """A started :class:`KVEventPublisher`, or ``None`` when ``config`` is ``None`` (publisher ``"null"``)."""
    if config is None or not config.enabled:
        return None
    return KVEventPublisher(config, data_parallel_rank, port_offset)


def check_endpoints(config: KVEventsConfig | None, dp_ranks) -> None:
    """Open and close the sockets of each DP rank in ``dp_ranks`` (start-up check before the ranks start).

    Raises:
        ValueError: the one-line error :class:`KVEventPublisher` raises for the first
            endpoint that cannot be bound or connected.
    """
    if config is None or not config.enabled:
        return
    for r in dp_ranks:
        KVEventPublisher(config, r, autostart=False).shutdown()
