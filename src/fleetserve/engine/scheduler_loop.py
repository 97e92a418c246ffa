"""A rank's event loop: receive messages, step the scheduler, send outputs.

Sockets (bound by the tokenizer manager, or by the DP relay when there are
several ranks; a rank connects):

* ``recv_sock``: PULL. :class:`TokenizedGenerateReq`, :class:`AbortReq`,
  :class:`FlushCacheReq`, :class:`GetStatsReq`, framed by
  :mod:`fleetserve.engine.io_frames`.
* ``send_sock``: PUSH. :class:`BatchTokenOut` (one per step that produced
  anything), :class:`SchedulerStats` (``dp_rank`` filled in) and
  :class:`FlushCacheOut`.

While there is work the loop runs one step per iteration, draining the socket
without blocking in between; when idle it waits on the socket.

Inside one attention group (``attn_tp_size > 1`` ranks, i.e. plain TP) only the
group's first rank (the *leader*) reads the socket; every iteration it
broadcasts what it received to the others over the group's gloo CPU group
(waking at least every ``HEARTBEAT_S`` seconds while idle, so the broadcast
never reaches the collective timeout). All ranks of a group then step in
lockstep on identical inputs; only the leader sends generated tokens, while
every rank answers stats and flush requests (the HTTP side expects one answer
per process).

Under DP attention (``always_step``) every iteration steps, because the DP
hook's collectives need every rank each step even when this rank is empty;
how long an idle leader waits then is :meth:`SchedulerLoop.idle_wait_ms`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist
import zmq

from fleetserve.distributed.parallel_state import SINGLE_RANK_STATE, ParallelState
from fleetserve.engine.io_frames import decode, encode
from fleetserve.engine.io_struct import (
    AbortReq, BatchTokenOut, FlushCacheOut, FlushCacheReq, GetStatsReq, ReqOutput, TokenizedGenerateReq,
)

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 2
MAX_IDLE_POLL_MS = 20
HEARTBEAT_S = 1.0


class SchedulerLoop:
    """Receive messages, step the scheduler, send outputs (see module docstring).

    Args:
        scheduler: a :class:`~fleetserve.engine.scheduler.Scheduler`.
        recv_sock: zmq PULL socket (connected on the leader; unused on other ranks).
        send_sock: connected zmq PUSH socket.
        dp_rank: written into stats and flush answers.
        always_step: step every iteration (DP attention).
        pstate: the rank's :class:`ParallelState` (its ``attn_tp_cpu_group`` carries
            the leader's broadcast when ``attn_tp_size > 1``).
        leader: this rank reads ``recv_sock`` and sends generated tokens.
    """

    def __init__(self, scheduler: Any, recv_sock: zmq.Socket, send_sock: zmq.Socket, dp_rank: int = 0,
                 always_step: bool = False, pstate: ParallelState = SINGLE_RANK_STATE, leader: bool = True):
        self.scheduler = scheduler
        self.recv_sock = recv_sock
        self.send_sock = send_sock
        self.dp_rank = dp_rank
        self.always_step = always_step
        self.pstate = pstate
        self.leader = leader
        self.group_src = pstate.attn_dp_rank * pstate.attn_tp_size  # the leader's rank in the group
        self.outbox: list[ReqOutput] = []
        self.poller = zmq.Poller()
        self.poller.register(recv_sock, zmq.POLLIN)
        self.running = True
        self.idle_ms = IDLE_POLL_MS
        self.last_forward_ct: int | None = None

    # ------------------------------------------------------------ messages
    def idle_wait_ms(self) -> int | None:
        """How long an idle leader waits for a message (``None``: until one comes).

        Alone (no group, no DP attention) it waits for the next message. Plain TP
        waits up to ``HEARTBEAT_S`` (the broadcast keeps the group in step). Under
        DP attention every iteration joins the per-step collectives: while another
        rank is busy (the last step ran a forward, IDLE here) this rank does not wait
        at all, so it never slows the others' steps; while every rank is idle it
        backs off from ``IDLE_POLL_MS`` to ``MAX_IDLE_POLL_MS`` (an idle instance then
        costs ~50 small all-gathers a second, and a request arriving at an idle
        instance waits at most that long for the other ranks).
        """
        if not self.always_step:
            return int(HEARTBEAT_S * 1000) if self.pstate.attn_tp_size > 1 else None
        ct = getattr(self.scheduler, "forward_ct", None)
        ran_forward, self.last_forward_ct = ct != self.last_forward_ct, ct
        if ran_forward:
            self.idle_ms = IDLE_POLL_MS
            return 0
        wait = self.idle_ms
        self.idle_ms = min(MAX_IDLE_POLL_MS, self.idle_ms * 2)
        return wait

    def drain(self) -> list[Any]:
        """Every message waiting on ``recv_sock`` now (undecodable ones are logged and dropped)."""
        msgs: list[Any] = []
        while True:
            try:
                frames = self.recv_sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return msgs
            try:
                msgs.append(decode(frames))
            except Exception:  # a bad message must not kill the scheduler
                logger.exception("undecodable message dropped")

    def recv_requests(self, block: bool) -> list[Any]:
        """This iteration's messages; an idle leader first waits (:meth:`idle_wait_ms`).

        With ``attn_tp_size > 1`` the leader's list is broadcast to the group, so
        every rank returns the same messages.
        """
        msgs: list[Any] = []
        if self.leader:
            if block:
                self.poller.poll(self.idle_wait_ms())
            else:
                self.idle_ms = IDLE_POLL_MS
            msgs = self.drain()
        if self.pstate.attn_tp_size == 1:
            return msgs
        box = [msgs]
        dist.broadcast_object_list(box, src=self.group_src, group=self.pstate.attn_tp_cpu_group)
        return box[0]

    def handle(self, msg: Any) -> None:
        s = self.scheduler
        if isinstance(msg, TokenizedGenerateReq):
            self.outbox.extend(s.add_request(msg))
        elif isinstance(msg, AbortReq):
            self.outbox.extend(s.abort(msg.rid))
        elif isinstance(msg, FlushCacheReq):
            self.send(FlushCacheOut(s.flush_cache(), self.dp_rank))
        elif isinstance(msg, GetStatsReq):
            st = s.get_stats()
            st.dp_rank = self.dp_rank
            self.send(st)
        else:
            logger.warning("unexpected message %r", type(msg).__name__)

    def send(self, obj: Any) -> None:
        """Send one message; generated tokens only from the leader."""
        if self.leader or not isinstance(obj, BatchTokenOut):
            self.send_sock.send_multipart(encode(obj))

    def flush_outbox(self) -> None:
        if self.outbox:
            self.send(BatchTokenOut(self.outbox))
            self.outbox = []

    # ---------------------------------------------------------------- loop
    def run_once(self) -> None:
        """One iteration: receive (waiting only when idle), step if there is work, send."""
        busy = self.scheduler.has_work()
        for m in self.recv_requests(block=not busy):
            self.handle(m)
        if self.always_step or self.scheduler.has_work():
            self.outbox.extend(self.scheduler.step())
        self.flush_outbox()

    def run_forever(self) -> None:
        while self.running:
            self.run_once()
