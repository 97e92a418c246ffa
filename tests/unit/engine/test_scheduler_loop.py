"""The scheduler's ZMQ loop: requests in, BatchTokenOut / stats / flush answers out."""

import threading

import zmq

from fleetserve.engine.io_frames import decode, encode
from fleetserve.engine.io_struct import (AbortReq, BatchTokenOut, FlushCacheOut, FlushCacheReq, GetStatsReq,
                                         SchedulerStats, TokenizedGenerateReq)
from fleetserve.engine.sampling_params import SamplingParams
from fleetserve.engine.scheduler_loop import SchedulerLoop


def test_loop_serves_requests_stats_abort_and_flush(tmp_path, make_sched):
    ctx = zmq.Context()
    to_sched = ctx.socket(zmq.PUSH)
    to_sched.bind(f"ipc://{tmp_path}/in")
    from_sched = ctx.socket(zmq.PULL)
    from_sched.bind(f"ipc://{tmp_path}/out")
    from_sched.setsockopt(zmq.RCVTIMEO, 5000)
    recv = ctx.socket(zmq.PULL)
    recv.connect(f"ipc://{tmp_path}/in")
    send = ctx.socket(zmq.PUSH)
    send.connect(f"ipc://{tmp_path}/out")
    sched = make_sched(pool_size=300)
    loop = SchedulerLoop(sched, recv, send, dp_rank=3)
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()

    def get():
        return decode(from_sched.recv_multipart())

    sp = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)
    to_sched.send_multipart(encode(TokenizedGenerateReq("a", [1, 2, 3, 4], sp, stream=True)))
    toks = []
    while True:
        m = get()
        assert isinstance(m, BatchTokenOut)
        (o,) = m.outputs
        toks += o.new_token_ids
        if o.finished:
            break
    assert len(toks) == 5 and o.finish_reason["type"] == "length"

    big = SamplingParams(max_new_tokens=10_000, temperature=0.0, ignore_eos=True)
    to_sched.send_multipart(encode(TokenizedGenerateReq("b", [5, 6, 7], big, stream=False)))
    to_sched.send_multipart(encode(GetStatsReq()))
    st = get()
    assert isinstance(st, SchedulerStats) and st.dp_rank == 3 and st.kv_pool_size == 300
    to_sched.send_multipart(encode(AbortReq("b")))
    m = get()
    assert m.outputs[0].rid == "b" and m.outputs[0].finish_reason["type"] == "abort"
    to_sched.send(b"not a pickle")  # dropped, loop keeps serving
    to_sched.send_multipart(encode(GetStatsReq())[:1] + [b"not a pickle"])  # a framed bad payload: dropped too
    to_sched.send_multipart(encode(FlushCacheReq()))
    fl = get()
    assert isinstance(fl, FlushCacheOut) and fl.success and fl.dp_rank == 3
    assert sched.cache.total_size() == 0 and sched.allocator.available_size() == 300
    loop.running = False
    to_sched.send_multipart(encode(GetStatsReq()))  # wake the blocked poll
    t.join(5)
    assert not t.is_alive()
    for s in (to_sched, from_sched, recv, send):
        s.close(0)
    ctx.term()
