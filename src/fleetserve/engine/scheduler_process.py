"""The scheduler's own process: a ZMQ event loop around :class:`Scheduler`.

Sockets (the HTTP process's tokenizer manager binds both; this side connects):

* ``input_endpoint``: PULL. Receives pickled io_struct messages:
  :class:`TokenizedGenerateReq`, :class:`AbortReq`, :class:`FlushCacheReq`,
  :class:`GetStatsReq`.
* ``output_endpoint``: PUSH. Sends pickled :class:`BatchTokenOut` (one per
  step that produced anything), :class:`SchedulerStats` (answer to
  GetStatsReq, ``dp_rank`` filled in) and :class:`FlushCacheOut`.

Start-up handshake: after the model is loaded and the sockets are connected,
the process sends one dict through a ``multiprocessing`` pipe:
``{"status": "ready", "vocab_size", "max_context_len", "eos_token_ids",
"max_total_tokens", "kv_bytes_per_token"}``, or ``{"status": "error",
"error": "<type>: <message>"}`` and exits with code 1.

Loop: while there is work it runs one step per iteration, draining the
socket without blocking in between; when idle it blocks on the socket (no
busy wait). Under DP attention (``always_step``) every iteration steps,
because the DP hook's collectives need every rank each step even when this
rank is empty; it waits at most ``IDLE_POLL_MS`` for messages then.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import signal
from dataclasses import dataclass
from typing import Any

import zmq

from fleetserve.engine.args import ServerArgs
from fleetserve.engine.dp_attention_hook import dp_attention_hook
from fleetserve.engine.io_struct import (
    AbortReq, BatchTokenOut, FlushCacheReq, GetStatsReq, ReqOutput, TokenizedGenerateReq,
)

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 2


@dataclass
class FlushCacheOut:
    """Answer to :class:`FlushCacheReq`: False while requests are queued or running."""

    success: bool
    dp_rank: int = 0


class SchedulerLoop:
    """Receive messages, step the scheduler, send outputs.

    Args:
        scheduler: a :class:`~fleetserve.engine.scheduler.Scheduler`.
        recv_sock: connected zmq PULL socket.
        send_sock: connected zmq PUSH socket.
        dp_rank: written into stats and flush answers.
        always_step: step every iteration (DP attention; see module docstring).
    """

    def __init__(self, scheduler: Any, recv_sock: zmq.Socket, send_sock: zmq.Socket, dp_rank: int = 0,
                 always_step: bool = False):
        self.scheduler = scheduler
        self.recv_sock = recv_sock
        self.send_sock = send_sock
        self.dp_rank = dp_rank
        self.always_step = always_step
        self.outbox: list[ReqOutput] = []
        self.poller = zmq.Poller()
        self.poller.register(recv_sock, zmq.POLLIN)
        self.running = True

    # ------------------------------------------------------------ messages
    def recv_requests(self, block: bool) -> list[Any]:
        """All pending messages; waits for the first one when ``block``.

        Under TP inside an attention group, the parallel layer replaces this to
        receive on the group's first rank and broadcast to the others.
        """
        msgs: list[Any] = []
        if block:
            timeout = IDLE_POLL_MS if self.always_step else None
            if not self.poller.poll(timeout):
                return msgs
        while True:
            try:
                raw = self.recv_sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                msgs.append(pickle.loads(raw))
            except Exception:  # a bad message must not kill the scheduler
                logger.exception("undecodable message dropped")
        return msgs

    def handle(self, msg: Any) -> None:
        s = self.scheduler
        if isinstance(msg, TokenizedGenerateReq):
            self.outbox.extend(s.add_request(msg))
        elif isinstance(msg, AbortReq):
            self.outbox.extend(s.abort(msg.rid))
        elif isinstance(msg, FlushCacheReq):
            self._send(FlushCacheOut(s.flush_cache(), self.dp_rank))
        elif isinstance(msg, GetStatsReq):
            st = s.get_stats()
            st.dp_rank = self.dp_rank
            self._send(st)
        else:
            logger.warning("unexpected message %r", type(msg).__name__)

    def _send(self, obj: Any) -> None:
        self.send_sock.send(pickle.dumps(obj))

    def flush_outbox(self) -> None:
        if self.outbox:
            self._send(BatchTokenOut(self.outbox))
            self.outbox = []

    # ---------------------------------------------------------------- loop
    def run_once(self) -> None:
        """One iteration: receive (blocking only when idle), step if there is work, send."""
        busy = self.scheduler.has_work()
        for m in self.recv_requests(block=not busy):
            self.handle(m)
        if self.always_step or self.scheduler.has_work():
            self.outbox.extend(self.scheduler.step())
        self.flush_outbox()

    def run_forever(self) -> None:
        while self.running:
            self.run_once()


def _make_runner(args: ServerArgs, pstate: Any) -> Any:
    from fleetserve.engine.model_runner import ModelRunner

    return ModelRunner(model_path=args.model_path, dtype=args.dtype, max_total_tokens=args.max_total_tokens,
                       mem_fraction_static=args.mem_fraction_static, pstate=pstate, device=args.device,
                       show_progress=False, disable_cuda_graph=args.disable_cuda_graph,
                       cuda_graph_max_bs=args.cuda_graph_max_bs)


def run_scheduler_process(args: ServerArgs, input_endpoint: str, output_endpoint: str, ready_writer: Any,
                          pstate: Any = None, dp_rank: int = 0, parent_pid: int | None = None) -> None:
    """Process entry point: load the model, connect, hand-shake, loop until terminated
    (SIGTERM, or ``parent_pid`` -- the server -- disappearing)."""
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s scheduler[{dp_rank}] %(name)s: %(message)s")
    from fleetserve.engine.parent_watch import no_leaks_on_abrupt_exit

    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    no_leaks_on_abrupt_exit()
    if parent_pid is not None:
        from fleetserve.engine.parent_watch import exit_with_parent

        exit_with_parent(parent_pid)
    try:
        from fleetserve.distributed.parallel_state import SINGLE_RANK_STATE
        from fleetserve.engine.scheduler import Scheduler

        pstate = pstate or SINGLE_RANK_STATE
        runner = _make_runner(args, pstate)
        hook = dp_attention_hook(pstate, args.device) if pstate.attn_dp_size > 1 else None
        scheduler = Scheduler(args, runner, dp_hook=hook)
        ctx = zmq.Context()
        recv = ctx.socket(zmq.PULL)
        recv.connect(input_endpoint)
        send = ctx.socket(zmq.PUSH)
        send.setsockopt(zmq.LINGER, 0)
        send.connect(output_endpoint)
    except Exception as e:  # report why, then exit non-zero
        logger.exception("scheduler start-up failed")
        ready_writer.send({"status": "error", "error": f"{type(e).__name__}: {e}"})
        os._exit(1)
    ready_writer.send({
        "status": "ready",
        "vocab_size": scheduler.vocab_size,
        "max_context_len": scheduler.max_context_len,
        "eos_token_ids": sorted(scheduler.eos_ids),
        "max_total_tokens": scheduler.pool_size,
        "kv_bytes_per_token": int(getattr(runner, "kv_bytes_per_token", 0) or 0),
        "dp_rank": dp_rank,
    })
    SchedulerLoop(scheduler, recv, send, dp_rank=dp_rank, always_step=hook is not None).run_forever()


def launch_scheduler(args: ServerArgs, input_endpoint: str, output_endpoint: str):
    """Start the scheduler process of a single-rank instance.

    Returns:
        ``([process], [ready_reader])``: the reader yields the handshake dict described
        in the module docstring. (Several ranks: ``fleetserve.engine.rank_process``.)
    """
    ctx = mp.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=run_scheduler_process, args=(args, input_endpoint, output_endpoint, writer),
                       kwargs={"parent_pid": os.getpid()}, name="fleetserve-scheduler", daemon=True)
    proc.start()
    writer.close()
    return [proc], [reader]
