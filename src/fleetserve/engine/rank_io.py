"""A rank's two ZMQ sockets, connected once at start-up.

The side that owns the endpoints (the tokenizer manager for a single rank, the
DP relay for several) binds them; a rank connects. Only an attention group's
leader connects its input: the other ranks of the group receive the leader's
broadcast instead (:mod:`fleetserve.engine.scheduler_loop`).
"""

from __future__ import annotations

from dataclasses import dataclass

import zmq


@dataclass(frozen=True)
class RankEndpoints:
    """Where the ranks of an instance connect.

    Attributes:
        inputs: per DP rank, the address of the bound PUSH that sends its requests
            (one entry for a single rank).
        output: address of the bound PULL that takes every rank's outputs.
    """

    inputs: tuple[str, ...]
    output: str


def connect_rank_io(endpoints: RankEndpoints, dp_rank: int, leader: bool) -> tuple[zmq.Socket, zmq.Socket]:
    """``(recv, send)``: a PULL (connected to ``endpoints.inputs[dp_rank]`` only when
    ``leader``) and a PUSH connected to ``endpoints.output``.

    Raises:
        IndexError: no input address for ``dp_rank``. zmq.ZMQError: an address zmq
        cannot connect to.
    """
    ctx = zmq.Context.instance()
    recv = ctx.socket(zmq.PULL)
    send = ctx.socket(zmq.PUSH)
    send.setsockopt(zmq.LINGER, 0)
    send.connect(endpoints.output)
    if leader:
        recv.connect(endpoints.inputs[dp_rank])
    return recv, send
