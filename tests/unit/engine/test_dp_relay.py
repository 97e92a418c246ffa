"""The DP relay between the tokenizer manager's sockets and the DP ranks (zmq only, no ranks)."""

import pickle

import zmq

from fleetserve.engine.dp_controller import DPController, DPRelay
from fleetserve.engine.io_struct import AbortReq, BatchTokenOut, GetStatsReq, ReqOutput, TokenizedGenerateReq
from fleetserve.engine.sampling_params import SamplingParams


def _recv(sock, timeout_ms=3000):
    assert sock.poll(timeout_ms), "nothing arrived"
    return pickle.loads(sock.recv())


def test_relay_routes_requests_aborts_broadcasts_and_outputs(tmp_path):
    ctx = zmq.Context()
    tm_push, tm_pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    tm_push.bind(f"ipc://{tmp_path}/tm_in")
    tm_pull.bind(f"ipc://{tmp_path}/tm_out")
    rank_eps = [f"ipc://{tmp_path}/r{d}" for d in range(2)]
    controller = DPController(2, "shortest_queue")
    relay = DPRelay(controller, f"ipc://{tmp_path}/tm_in", f"ipc://{tmp_path}/tm_out", rank_eps,
                    f"ipc://{tmp_path}/out").start()
    ranks = []
    for ep in rank_eps:
        s = ctx.socket(zmq.PULL)
        s.connect(ep)
        ranks.append(s)
    out = ctx.socket(zmq.PUSH)
    out.connect(f"ipc://{tmp_path}/out")
    try:
        sp = SamplingParams(max_new_tokens=4)
        tm_push.send(pickle.dumps(TokenizedGenerateReq("a", list(range(50)), sp)))
        assert _recv(ranks[0]).rid == "a"                      # both empty: rank 0
        tm_push.send(pickle.dumps(TokenizedGenerateReq("b", list(range(10)), sp)))
        assert _recv(ranks[1]).rid == "b"                      # shortest queue: rank 1 (0 < 50)
        tm_push.send(pickle.dumps(TokenizedGenerateReq("c", list(range(10)), sp)))
        assert _recv(ranks[1]).rid == "c"                      # 10 < 50
        tm_push.send(pickle.dumps(AbortReq("a")))
        assert isinstance(_recv(ranks[0]), AbortReq)           # abort goes where "a" runs
        assert not ranks[1].poll(200)
        tm_push.send(pickle.dumps(GetStatsReq()))
        assert isinstance(_recv(ranks[0]), GetStatsReq) and isinstance(_recv(ranks[1]), GetStatsReq)
        done = ReqOutput("a", [7], True, {"type": "abort"}, 50, 1, 0)
        out.send(pickle.dumps(BatchTokenOut([done])))
        got = _recv(tm_pull)
        assert isinstance(got, BatchTokenOut) and got.outputs[0].rid == "a"
        assert controller.loads() == [0, 20] and controller.rank_of("a") is None
    finally:
        relay.stop()
        for s in (tm_push, tm_pull, out, *ranks):
            s.close(0)
        ctx.term()
