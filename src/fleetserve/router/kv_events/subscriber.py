"""One ZMQ subscription per (worker, DP rank): receive, decode, check the sequence, replay, index.

Each :class:`Subscription` runs a daemon thread with its own SUB socket
(pyzmq), so decoding never runs on the router's event loop.  It applies each
event to the shared :class:`~.index.BlockIndex` under the index lock, one
event per hold, and gives up the GIL every :data:`EVENTS_PER_SLICE` events, so
a flood of events delays a routing decision by at most one small slice.

Trust (``Subscription.state``), the state machine of docs/router.md:

* ``fallback``: no batch received yet, or a sequence gap that could not be
  repaired.  The policy routes this target by the approximate tree.
* ``degraded``: receiving, but the history before the first batch seen is
  unknown (joined mid-stream, no replay reaching back to seq 0): the index
  holds a subset of the engine's blocks.
* ``exact``: every batch since the publisher's seq 0 (or since its last
  ``AllBlocksCleared``) has been applied in order.

Transitions: first batch with seq 0 -> exact; first batch with seq > 0 ->
replay from 0 if there is a replay endpoint (exact if it reaches back to 0,
else degraded), else degraded.  A gap (seq > last + 1) -> replay from
last + 1; if the replay covers the gap, the state is kept, else the target's
entries are dropped and it turns fallback.  ``AllBlocksCleared`` in order ->
exact.  A seq that goes back to 0 (the engine restarted) drops the entries
and starts over.  Older duplicates (replay overlap) are skipped.

A lost connection (the SUB socket's ``EVENT_DISCONNECTED`` after it was
connected: the engine exited, or the link broke) drops the target's entries
and turns ``exact`` into ``degraded``: an engine that exited lost its cache, so
its old entries would predict hits it no longer has (until its first event
after a restart told so); if it lived on, what the index holds is now a
subset of its blocks, which is what ``degraded`` means.  ``on_lost`` (when
given) is then called with the target from the subscription's thread, so that
the policy can drop the approximate tree's entries too (:mod:`.sources`).

Replay (vLLM / SGLang ``ZmqEventPublisher._service_replay``): a DEALER sends
``[b"", start_seq]``; the publisher's ROUTER answers ``[b"", seq, payload]``
per buffered batch with seq >= start_seq, then ``[b"", -1, b""]``.
"""

from __future__ import annotations

import logging
import threading
import time

import zmq
from zmq.utils.monitor import parse_monitor_message

from .decode import AllBlocksCleared, MalformedFrame, decode_batch, decode_message, decode_seq, encode_seq
from .index import BlockIndex

log = logging.getLogger("fleetserve.router")

FALLBACK, DEGRADED, EXACT = "fallback", "degraded", "exact"
EVENTS_PER_SLICE = 64  # events applied between two GIL releases
MAX_MSGS_PER_ROUND = 256  # messages taken from the socket before re-checking the stop flag
REPLAY_TIMEOUT_S = 2.0


class Subscription:
    """The KV-event stream of one (worker, DP rank); see the module docstring."""

    def __init__(self, worker_url: str, rank: int, endpoint: str, index: BlockIndex,
                 replay_endpoint: str | None = None, topic: str = "", ctx: zmq.Context | None = None,
                 on_lost=None) -> None:
        self.worker_url = worker_url
        self.rank = rank
        self.target = (worker_url, rank)
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.index = index
        self.ctx = ctx or zmq.Context.instance()
        self.state = FALLBACK
        self.last_seq: int | None = None
        self.batches = 0
        self.events = 0
        self.malformed = 0
        self.gaps = 0
        self.replays = 0
        self.replay_failures = 0
        self.rank_mismatches = 0
        self.disconnects = 0  # lost publisher connections (see the module docstring)
        self.on_lost = on_lost  # called with the target after a lost connection dropped its entries
        self._connected = False  # the SUB socket's monitor saw it connected (and not disconnected since)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"kv-events {worker_url} rank {rank}")

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        """Ask the thread to end and wait for it up to ``timeout`` s (it polls every 0.1 s)."""
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def counters(self) -> dict:
        return {"state": self.state, "last_seq": self.last_seq, "batches": self.batches, "events": self.events,
                "malformed": self.malformed, "gaps": self.gaps, "replays": self.replays,
                "replay_failures": self.replay_failures}

    # ------------------------------------------------------------ the thread
    def _run(self) -> None:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        mon = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(mon, zmq.POLLIN)
        try:
            sub.connect(self.endpoint)
            while not self._stop.is_set():
                ready = dict(poller.poll(100))
                if mon in ready:
                    self._on_monitor(mon)
                if sub not in ready:
                    continue
                for _ in range(MAX_MSGS_PER_ROUND):
                    try:
                        frames = sub.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.on_message(frames)
                    if self._stop.is_set():
                        break
        except Exception:  # pragma: no cover - keep the router alive whatever a socket does
            log.exception("kv-events subscription %s rank %d ended", self.worker_url, self.rank)
        finally:
            sub.disable_monitor()
            mon.close(0)
            sub.close(0)

    def _on_monitor(self, mon) -> None:
        """Drain the SUB socket's monitor: a disconnect after a connect is a lost publisher."""
        while True:
            try:
                frames = mon.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                event = parse_monitor_message(frames)["event"]
            except Exception:  # pragma: no cover - not a monitor message
                continue
            if event == zmq.EVENT_CONNECTED:
                self._connected = True
            elif event == zmq.EVENT_DISCONNECTED and self._connected:
                self._connected = False
                self.lost()

    def lost(self) -> None:
        """The connection to the publisher was lost: drop the target's entries, ``exact`` -> ``degraded``
        (see the module docstring), and tell ``on_lost``.  Also callable without a thread, for tests."""
        self.disconnects += 1
        self.index.drop_target(self.target)
        if self.state == EXACT:
            self.state = DEGRADED
        log.warning("kv-events %s rank %d: publisher connection lost (engine exited?): its entries dropped, "
                    "trust %s until its events say more", self.worker_url, self.rank, self.state)
        if self.on_lost is not None:
            try:
                self.on_lost(self.target)
            except Exception:  # pragma: no cover - a closed event loop at shutdown
                log.debug("kv-events: on_lost failed", exc_info=True)

    def on_message(self, frames: list[bytes]) -> None:
        """Handle one live ``[topic, seq, payload]`` message (also callable without a thread, for tests)."""
        try:
            seq, batch = decode_message(frames)
        except MalformedFrame as e:
            self._malformed(e)
            return
        last = self.last_seq
        if last is not None and seq <= last:
            if seq != 0:
                return  # a duplicate (replay overlap)
            log.warning("kv-events %s rank %d: sequence restarted at 0 (engine restart?): entries dropped",
                        self.worker_url, self.rank)
            self.index.drop_target(self.target)
            last = self.last_seq = None
        if last is None:
            if seq == 0:
                self.state = EXACT
            else:
                self.state = EXACT if (self.replay_endpoint and self._replay(0)) else DEGRADED
        elif seq > last + 1:
            self.gaps += 1
            if not (self.replay_endpoint and self._replay(last + 1)):
                self._unrepaired(last + 1, seq - 1)
        if self.last_seq is not None and seq <= self.last_seq:
            return  # the replay already applied it
        if self.last_seq is not None and seq != self.last_seq + 1:
            self._unrepaired(self.last_seq + 1, seq - 1)  # the replay ended short of this one
        self._apply(seq, batch)

    def _malformed(self, e: Exception) -> None:
        self.malformed += 1
        if self.malformed <= 3 or self.malformed % 1000 == 0:
            log.warning("kv-events %s rank %d: malformed message skipped (%s; %d so far)", self.worker_url,
                        self.rank, e, self.malformed)

    def _unrepaired(self, lo: int, hi: int) -> None:
        log.warning("kv-events %s rank %d: gap %d..%d not repaired: routed by the approximate tree until a "
                    "clean state (AllBlocksCleared or a restart at seq 0)", self.worker_url, self.rank, lo, hi)
        self.index.drop_target(self.target)
        self.state = FALLBACK
        self.last_seq = hi  # go on from the message that showed the gap (indexed, but not trusted)

    def _apply(self, seq: int, batch) -> None:
        if batch.dp_rank is not None and batch.dp_rank != self.rank:
            self.rank_mismatches += 1
        events = batch.events
        ix = self.index
        for i in range(0, len(events), EVENTS_PER_SLICE):
            if self._stop.is_set():
                return  # unsubscribed: the worker's entries are being dropped, add none
            for ev in events[i:i + EVENTS_PER_SLICE]:
                ix.apply(self.target, ev)
                if type(ev) is AllBlocksCleared:
                    self.state = EXACT  # everything after a clear is seen
            time.sleep(0)  # let the event loop thread take the GIL between slices
        self.batches += 1
        self.events += len(events)
        self.last_seq = seq

    def _replay(self, start: int) -> bool:
        """Ask the replay endpoint for the batches from ``start``; True if they reach back to ``start``.

        The batches are applied in order when they start at ``start`` (or, for
        ``start == 0``, wherever the publisher's buffer begins: nothing is known
        before them anyway).  False on a timeout, a malformed answer or a hole.
        """
        self.replays += 1
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        got = []
        ended = False
        try:
            sock.connect(self.replay_endpoint)
            sock.send_multipart([b"", encode_seq(start)])
            deadline = time.monotonic() + REPLAY_TIMEOUT_S
            while not self._stop.is_set():
                left = deadline - time.monotonic()
                if left <= 0 or not sock.poll(int(left * 1000) + 1):
                    break
                frames = sock.recv_multipart()
                try:
                    if len(frames) != 3 or frames[0] != b"":
                        raise MalformedFrame(f"replay answer of {len(frames)} frames")
                    seq = decode_seq(frames[1])
                    if seq == -1:
                        ended = True
                        break
                    got.append((seq, decode_batch(frames[2])))
                except MalformedFrame as e:
                    self._malformed(e)
                    break
        except zmq.ZMQError as e:
            log.warning("kv-events %s rank %d: replay from %s failed: %s", self.worker_url, self.rank,
                        self.replay_endpoint, e)
        finally:
            sock.close(0)
        got = sorted(g for g in got if g[0] >= start)
        covered = ended and bool(got) and got[0][0] == start
        if not (covered or (start == 0 and got)):
            self.replay_failures += 1
            return False
        for seq, batch in got:
            if self.last_seq is not None and seq != self.last_seq + 1:
                self.replay_failures += 1
                return False  # a hole inside the replay
            self._apply(seq, batch)
        return covered
