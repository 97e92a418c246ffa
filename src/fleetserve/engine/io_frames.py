"""How :mod:`~fleetserve.engine.io_struct` messages travel over ZMQ: two frames.

Every message is sent as a multipart ``[header, payload]``:

* ``payload``: the pickled message, read only by the process it is meant for;
* ``header``: a few bytes of JSON saying what a router in between needs to
  know without unpickling the payload -- the message's kind, its request id,
  a generate request's routed DP rank (when it names one), and token counts
  (the prompt length of a generate request; per output of a
  :class:`~fleetserve.engine.io_struct.BatchTokenOut`, the request id, the
  number of new tokens and whether it finished).

The DP relay (:class:`~fleetserve.engine.dp_relay.DPRelay`) routes and
counts load from the header alone and forwards both frames untouched.
"""

from __future__ import annotations

import json
import pickle
from dataclasses import dataclass
from typing import Any

from fleetserve.engine.io_struct import AbortReq, BatchTokenOut, TokenizedGenerateReq

GENERATE = "generate"   # a TokenizedGenerateReq: rid, prompt tokens
ABORT = "abort"         # an AbortReq: rid
TOKENS = "tokens"       # a BatchTokenOut: per output (rid, new tokens, finished)
OTHER = "other"         # flush / stats requests and their answers


class FrameError(ValueError):
    """Frames that are not a ``[header, payload]`` pair with a readable header."""


@dataclass(frozen=True)
class Header:
    """What a message's first frame says about it.

    Attributes:
        kind: ``GENERATE``, ``ABORT``, ``TOKENS`` or ``OTHER``.
        rid: the request id (``GENERATE`` and ``ABORT``; else ``""``).
        num_tokens: prompt tokens of a ``GENERATE`` request (else 0).
        outputs: for ``TOKENS``, one ``(rid, new_tokens, finished)`` per output.
        routed_dp_rank: for ``GENERATE``, the DP rank the request must go to (None: any).
    """

    kind: str
    rid: str = ""
    num_tokens: int = 0
    outputs: tuple[tuple[str, int, bool], ...] = ()
    routed_dp_rank: int | None = None


def header_of(msg: Any) -> Header:
    """The header for ``msg`` (any io_struct message; unknown types are ``OTHER``)."""
    if isinstance(msg, TokenizedGenerateReq):
        return Header(GENERATE, msg.rid, len(msg.input_ids), routed_dp_rank=msg.routed_dp_rank)
    if isinstance(msg, AbortReq):
        return Header(ABORT, msg.rid)
    if isinstance(msg, BatchTokenOut):
        return Header(TOKENS, outputs=tuple((o.rid, len(o.new_token_ids), bool(o.finished)) for o in msg.outputs))
    return Header(OTHER)


def encode(msg: Any) -> list[bytes]:
    """``[header, payload]`` for ``msg`` (send with ``socket.send_multipart``)."""
    h = header_of(msg)
    fields: list[Any] = [h.kind, h.rid, h.num_tokens, [list(o) for o in h.outputs]]
    if h.routed_dp_rank is not None:  # a fifth element only when there is one
        fields.append(int(h.routed_dp_rank))
    head = json.dumps(fields, separators=(",", ":"))
    return [head.encode(), pickle.dumps(msg)]


def read_header(frames: list[bytes]) -> Header:
    """The header of ``frames`` (the payload is not touched).

    Raises:
        FrameError: not two frames, or a header that is not this module's JSON.
    """
    if len(frames) != 2:
        raise FrameError(f"expected [header, payload], got {len(frames)} frame(s)")
    try:
        kind, rid, num_tokens, outputs, *rest = json.loads(frames[0])
        if len(rest) > 1:
            raise ValueError(f"{4 + len(rest)} header fields")
        routed = int(rest[0]) if rest and rest[0] is not None else None
        return Header(str(kind), str(rid), int(num_tokens),
                      tuple((str(r), int(n), bool(f)) for r, n, f in outputs), routed)
    except (ValueError, TypeError) as e:
        raise FrameError(f"unreadable header: {e}") from e


def decode(frames: list[bytes]) -> Any:
    """The message carried by ``frames``.

    Raises:
        FrameError: not two frames. Whatever ``pickle.loads`` raises for a bad payload.
    """
    if len(frames) != 2:
        raise FrameError(f"expected [header, payload], got {len(frames)} frame(s)")
    return pickle.loads(frames[1])
