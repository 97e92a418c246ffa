"""The DP relay: a thread between the tokenizer manager and the DP ranks' schedulers.

It routes by each message's header frame (:mod:`fleetserve.engine.io_frames`)
and forwards the frames untouched: it never unpickles a payload, in either
direction, so its cost does not grow with the size of prompts or outputs.
"""

from __future__ import annotations

import logging
import threading

import zmq

from fleetserve.engine.dp_controller import DPController
from fleetserve.engine.io_frames import ABORT, GENERATE, TOKENS, FrameError, Header, encode, read_header
from fleetserve.engine.io_struct import BatchTokenOut, ReqOutput

logger = logging.getLogger(__name__)


class DPRelay:
    """Between the tokenizer manager and the ``dp_size`` ranks' schedulers (a thread).

    The tokenizer manager binds one PUSH (requests) and one PULL (outputs)
    socket. The relay connects to both, binds one PUSH per DP rank
    (``rank_endpoints[d]``; the first rank of DP rank ``d``'s attention group, or of
    replica ``d``, connects its PULL there) and one PULL that every such rank
    pushes its outputs to (``outputs_endpoint``).

    Routing: a generate request goes to :meth:`DPController.assign`'s rank (the
    rank its header names, if any); an
    abort to the rank serving it (to all when unknown); flush and stats requests
    to every rank. Outputs are forwarded unchanged and update the controller's
    loads (tokens generated, finished requests) from their header. A generate
    request the controller refuses (its id already running, a routed rank out of
    range) is answered at once with a finished abort output. Frames without a
    readable header are logged and dropped.

    Args:
        controller: the :class:`DPController`.
        tm_send_endpoint / tm_recv_endpoint: the tokenizer manager's bound PUSH / PULL.
        rank_endpoints: one address per DP rank to bind a PUSH on.
        outputs_endpoint: address to bind the ranks' output PULL on.

    Raises:
        ValueError: ``len(rank_endpoints) != controller.dp_size``.
        zmq.ZMQError: an address that cannot be bound or connected.
    """

    def __init__(self, controller: DPController, tm_send_endpoint: str, tm_recv_endpoint: str,
                 rank_endpoints: list[str], outputs_endpoint: str):
        if len(rank_endpoints) != controller.dp_size:
            raise ValueError(f"{len(rank_endpoints)} rank endpoints for dp_size {controller.dp_size}")
        self.controller = controller
        self.ctx = zmq.Context()
        # The tokenizer manager binds after the ranks are up; retry the connection every
        # 10 ms (zmq's default is 100 ms) so requests right after start-up find the relay.
        self.from_tm = self.ctx.socket(zmq.PULL)
        self.from_tm.setsockopt(zmq.RECONNECT_IVL, 10)
        self.from_tm.connect(tm_send_endpoint)
        self.to_tm = self.ctx.socket(zmq.PUSH)
        self.to_tm.setsockopt(zmq.LINGER, 0)
        self.to_tm.setsockopt(zmq.RECONNECT_IVL, 10)
        self.to_tm.connect(tm_recv_endpoint)
        self.to_ranks = []
        for ep in rank_endpoints:
            s = self.ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 0)
            s.bind(ep)
            self.to_ranks.append(s)
        self.from_ranks = self.ctx.socket(zmq.PULL)
        self.from_ranks.bind(outputs_endpoint)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "DPRelay":
        self._thread = threading.Thread(target=self._run, name="dp-relay", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)

    def from_rank(self, header: Header, frames: list[bytes]) -> None:
        """Count an output's tokens, then pass it to the tokenizer manager."""
        if header.kind == TOKENS:
            for rid, new_tokens, finished in header.outputs:
                self.controller.on_tokens(rid, new_tokens, finished)
        self.to_tm.send_multipart(frames)

    def from_tokenizer_manager(self, header: Header, frames: list[bytes]) -> None:
        """Send a request to the rank(s) it belongs to."""
        if header.kind == GENERATE:
            try:
                rank = self.controller.assign(header.rid, header.num_tokens, header.routed_dp_rank)
            except ValueError as e:  # end it for its client rather than leave it waiting
                logger.warning("request %s refused by the DP relay: %s", header.rid, e)
                out = ReqOutput(header.rid, [], True, {"type": "abort", "message": str(e)}, header.num_tokens, 0, 0)
                self.to_tm.send_multipart(encode(BatchTokenOut([out])))
                return
            self.to_ranks[rank].send_multipart(frames)
            return
        serving = self.controller.rank_of(header.rid) if header.kind == ABORT else None
        for s in ([self.to_ranks[serving]] if serving is not None else self.to_ranks):
            s.send_multipart(frames)  # flush, stats, aborts of unknown requests: every rank

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.from_tm, zmq.POLLIN)
        poller.register(self.from_ranks, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                for sock, _ in poller.poll(200):
                    frames = sock.recv_multipart()
                    try:
                        header = read_header(frames)
                    except FrameError:
                        logger.exception("unreadable message dropped by the DP relay")
                        continue
                    if sock is self.from_ranks:
                        self.from_rank(header, frames)
                    else:
                        self.from_tokenizer_manager(header, frames)
        finally:
            for s in (self.from_tm, self.to_tm, self.from_ranks, *self.to_ranks):
                s.close(0)
            self.ctx.term()
