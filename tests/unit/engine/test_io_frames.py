"""The [header, payload] framing of inter-process messages."""

import pytest

from fleetserve.engine.io_frames import (ABORT, GENERATE, OTHER, TOKENS, FrameError, Header, decode, encode,
                                         header_of, read_header)
from fleetserve.engine.io_struct import (AbortReq, BatchTokenOut, FlushCacheOut, GetStatsReq, ReqOutput,
                                         TokenizedGenerateReq)
from fleetserve.engine.sampling_params import SamplingParams


def test_headers_carry_kind_rid_and_token_counts():
    req = TokenizedGenerateReq("g1", [4, 5, 6, 7], SamplingParams(max_new_tokens=3))
    assert header_of(req) == Header(GENERATE, "g1", 4)
    assert header_of(AbortReq("g1")) == Header(ABORT, "g1")
    out = BatchTokenOut([ReqOutput("a", [1, 2, 3], False, None, 4, 3, 0), ReqOutput("b", [], True, None, 2, 5, 0)])
    assert header_of(out) == Header(TOKENS, outputs=(("a", 3, False), ("b", 0, True)))
    assert header_of(GetStatsReq()).kind == header_of(FlushCacheOut(True)).kind == OTHER


@pytest.mark.parametrize("msg", [TokenizedGenerateReq("r", [1, 2], SamplingParams(stop=["x"])), AbortReq("r"),
                                 BatchTokenOut([ReqOutput("r", [9], True, {"type": "length", "length": 1}, 2, 1, 0)]),
                                 FlushCacheOut(False, dp_rank=2)])
def test_round_trip(msg):
    frames = encode(msg)
    assert len(frames) == 2
    assert decode(frames) == msg
    assert read_header(frames) == header_of(msg)


def test_bad_frames_raise_frame_error():
    with pytest.raises(FrameError, match="1 frame"):
        read_header([b"only one"])
    with pytest.raises(FrameError, match="1 frame"):
        decode([b"only one"])
    with pytest.raises(FrameError, match="unreadable header"):
        read_header([b"{not json", b"payload"])
    with pytest.raises(FrameError, match="unreadable header"):
        read_header([b'["generate", "r"]', b"payload"])  # too few fields


def test_generate_header_carries_the_routed_dp_rank_only_when_set():
    sp = SamplingParams(max_new_tokens=3)
    routed = encode(TokenizedGenerateReq("g", [1, 2, 3], sp, routed_dp_rank=1))
    assert routed[0] == b'["generate","g",3,[],1]'
    assert read_header(routed) == Header(GENERATE, "g", 3, routed_dp_rank=1)
    plain = encode(TokenizedGenerateReq("g", [1, 2, 3], sp))
    assert plain[0] == b'["generate","g",3,[]]'            # unchanged wire bytes without a rank
    assert read_header(plain).routed_dp_rank is None
    with pytest.raises(FrameError, match="6 header fields"):
        read_header([b'["generate","g",3,[],1,2]', b"payload"])
