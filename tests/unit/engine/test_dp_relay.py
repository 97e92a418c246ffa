"""The DP relay between the tokenizer manager's sockets and the DP ranks (zmq only, no ranks)."""

import pytest
import zmq

from fleetserve.engine.dp_controller import DPController
from fleetserve.engine.dp_relay import DPRelay
from fleetserve.engine.io_frames import decode, encode
from fleetserve.engine.io_struct import AbortReq, BatchTokenOut, GetStatsReq, ReqOutput, TokenizedGenerateReq
from fleetserve.engine.sampling_params import SamplingParams


def _recv(sock, timeout_ms=3000):
    assert sock.poll(timeout_ms), "nothing arrived"
    return decode(sock.recv_multipart())


class Net:
    """A relay between bound tokenizer-manager sockets and two connected DP ranks."""

    def __init__(self, tmp_path, method):
        self.ctx = zmq.Context()
        self.tm_push, self.tm_pull = self.ctx.socket(zmq.PUSH), self.ctx.socket(zmq.PULL)
        self.tm_push.bind(f"ipc://{tmp_path}/tm_in")
        self.tm_pull.bind(f"ipc://{tmp_path}/tm_out")
        rank_eps = [f"ipc://{tmp_path}/r{d}" for d in range(2)]
        self.controller = DPController(2, method)
        self.relay = DPRelay(self.controller, f"ipc://{tmp_path}/tm_in", f"ipc://{tmp_path}/tm_out", rank_eps,
                             f"ipc://{tmp_path}/out").start()
        self.ranks = []
        for ep in rank_eps:
            s = self.ctx.socket(zmq.PULL)
            s.connect(ep)
            self.ranks.append(s)
        self.out = self.ctx.socket(zmq.PUSH)
        self.out.connect(f"ipc://{tmp_path}/out")

    def close(self):
        self.relay.stop()
        for s in (self.tm_push, self.tm_pull, self.out, *self.ranks):
            s.close(0)
        self.ctx.term()


@pytest.fixture
def make_net(tmp_path):
    """``make_net(method)``: a started :class:`Net`, closed after the test."""
    nets = []
    yield lambda method: nets.append(Net(tmp_path, method)) or nets[-1]
    for n in nets:
        n.close()


def test_relay_routes_requests_aborts_broadcasts_and_outputs(make_net):
    net = make_net("shortest_queue")
    sp = SamplingParams(max_new_tokens=4)
    net.tm_push.send_multipart(encode(TokenizedGenerateReq("a", list(range(50)), sp)))
    assert _recv(net.ranks[0]).rid == "a"                      # both empty: rank 0
    net.tm_push.send_multipart(encode(TokenizedGenerateReq("b", list(range(10)), sp)))
    assert _recv(net.ranks[1]).rid == "b"                      # shortest queue: rank 1 (0 < 50)
    net.tm_push.send_multipart(encode(TokenizedGenerateReq("c", list(range(10)), sp)))
    assert _recv(net.ranks[1]).rid == "c"                      # 10 < 50
    net.tm_push.send_multipart(encode(AbortReq("a")))
    assert isinstance(_recv(net.ranks[0]), AbortReq)           # abort goes where "a" runs
    assert not net.ranks[1].poll(200)
    net.tm_push.send_multipart(encode(GetStatsReq()))
    assert isinstance(_recv(net.ranks[0]), GetStatsReq) and isinstance(_recv(net.ranks[1]), GetStatsReq)
    done = ReqOutput("a", [7], True, {"type": "abort"}, 50, 1, 0)
    net.out.send_multipart(encode(BatchTokenOut([done])))
    got = _recv(net.tm_pull)
    assert isinstance(got, BatchTokenOut) and got.outputs[0].rid == "a"
    assert net.controller.loads() == [0, 20] and net.controller.rank_of("a") is None


def test_relay_routes_by_header_and_forwards_payload_bytes_untouched(make_net):
    """Payloads the relay could not unpickle still arrive byte for byte where their header
    says, and the loads follow the header's token counts."""
    net = make_net("round_robin")
    opaque = b"\x80\x05 not a pickle at all"
    sp = SamplingParams(max_new_tokens=4)
    for rid, n in (("x", 30), ("y", 7)):
        head = encode(TokenizedGenerateReq(rid, list(range(n)), sp))[0]
        net.tm_push.send_multipart([head, opaque + rid.encode()])
    assert net.ranks[0].poll(3000) and net.ranks[0].recv_multipart()[1] == opaque + b"x"   # round robin: rank 0
    assert net.ranks[1].poll(3000) and net.ranks[1].recv_multipart()[1] == opaque + b"y"   # then rank 1
    assert net.controller.loads() == [30, 7]
    head = encode(BatchTokenOut([ReqOutput("x", [1, 2, 3], False, None, 30, 3, 0),
                                 ReqOutput("y", [4], True, None, 7, 1, 0)]))[0]
    net.out.send_multipart([head, opaque])
    assert net.tm_pull.poll(3000) and net.tm_pull.recv_multipart() == [head, opaque]
    assert net.controller.loads() == [33, 0] and net.controller.rank_of("y") is None
    net.tm_push.send_multipart([encode(AbortReq("x"))[0], opaque])
    assert net.ranks[0].poll(3000) and net.ranks[0].recv_multipart()[1] == opaque
    assert not net.ranks[1].poll(200)


def test_relay_sends_a_routed_request_to_its_rank_and_refuses_impossible_ones(make_net):
    net = make_net("round_robin")
    sp = SamplingParams(max_new_tokens=4)
    net.tm_push.send_multipart(encode(TokenizedGenerateReq("p", [1, 2, 3], sp, routed_dp_rank=1)))
    assert _recv(net.ranks[1]).rid == "p"                     # round robin alone would pick rank 0
    net.tm_push.send_multipart(encode(TokenizedGenerateReq("q", [1, 2], sp)))
    assert _recv(net.ranks[0]).rid == "q"                     # the turn was not used up
    assert net.controller.loads() == [2, 3]
    net.tm_push.send_multipart(encode(TokenizedGenerateReq("p", [1], sp)))   # "p" still runs: refused
    got = _recv(net.tm_pull)
    assert isinstance(got, BatchTokenOut) and got.outputs[0].rid == "p" and got.outputs[0].finished
    assert got.outputs[0].finish_reason["type"] == "abort" and "already assigned" in got.outputs[0].finish_reason["message"]
    net.tm_push.send_multipart(encode(TokenizedGenerateReq("r", [1], sp, routed_dp_rank=5)))
    got = _recv(net.tm_pull)
    assert got.outputs[0].rid == "r" and got.outputs[0].finish_reason["message"] == "routed_dp_rank=5 out of range [0, 2)"
    assert not net.ranks[0].poll(200) and not net.ranks[1].poll(0)
    assert net.controller.loads() == [2, 3]
