"""One rank start-up for every world size: build_rank, its loop and its handshake."""

import time

import pytest
import zmq

from fleetserve.distributed.parallel_state import SINGLE_RANK_STATE, ParallelState
from fleetserve.engine.args import ServerArgs
from fleetserve.engine.io_frames import decode, encode
from fleetserve.engine.io_struct import BatchTokenOut, FlushCacheOut, GetStatsReq, ReqOutput
from fleetserve.engine.rank_builder import build_rank
from fleetserve.engine.rank_io import RankEndpoints
from fleetserve.engine.rank_process import ready_message
from fleetserve.engine.scheduler_loop import HEARTBEAT_S, IDLE_POLL_MS, MAX_IDLE_POLL_MS, SchedulerLoop
from helpers.fake_runner import FakeRunner

# Attention group 1 of 2 (ranks 2, 3), second rank of it: not the group's leader.
DP_ATTN_FOLLOWER = ParallelState(tp_rank=3, tp_size=4, attn_tp_rank=1, attn_tp_size=2, attn_dp_rank=1,
                                 attn_dp_size=2)


class _Sockets:
    """Bound ends standing in for the tokenizer manager (or relay): a PUSH per DP rank, one PULL."""

    def __init__(self, tmp_path, dp_size=2):
        self.ctx = zmq.Context()
        self.inputs = []
        for d in range(dp_size):
            s = self.ctx.socket(zmq.PUSH)
            s.bind(f"ipc://{tmp_path}/in{d}")
            self.inputs.append(s)
        self.output = self.ctx.socket(zmq.PULL)
        self.output.bind(f"ipc://{tmp_path}/out")
        self.endpoints = RankEndpoints(tuple(f"ipc://{tmp_path}/in{d}" for d in range(dp_size)), f"ipc://{tmp_path}/out")

    def close(self, *loops):
        for lp in loops:
            lp.recv_sock.close(0)
            lp.send_sock.close(0)
        for s in (*self.inputs, self.output):
            s.close(0)
        self.ctx.term()


def test_single_rank_gets_the_unchanged_args_and_a_leader_loop(tmp_path):
    io = _Sockets(tmp_path)
    args = ServerArgs(random_seed=0, chunked_prefill_size=512)
    rank = build_rank(args, SINGLE_RANK_STATE, replica=1, runner=FakeRunner(pool_size=64), endpoints=io.endpoints)
    try:
        assert rank.dp_hook is None and rank.leader and rank.dp_rank == 1
        assert rank.args.chunked_prefill_size == 512 and rank.args.schedule_conservativeness == 1.0
        assert isinstance(rank.loop, SchedulerLoop) and not rank.loop.always_step and rank.loop.dp_rank == 1
        io.inputs[1].send_multipart(encode(GetStatsReq()))  # replica 1 reads DP rank 1's input
        rank.loop.run_once()
        assert io.output.poll(3000)
        st = decode(io.output.recv_multipart())
        assert st.dp_rank == 1 and st.kv_pool_size == 64
        assert ready_message(rank, 1) == {
            "status": "ready", "vocab_size": 50, "max_context_len": 1024, "eos_token_ids": [],
            "max_total_tokens": 64, "kv_bytes_per_token": 0, "dp_rank": 1, "tp_rank": 0, "rank": 1}
    finally:
        io.close(rank.loop)


def test_dp_attention_rank_gets_the_rule_the_hook_and_a_follower_loop(tmp_path):
    io = _Sockets(tmp_path)
    args = ServerArgs(random_seed=0, chunked_prefill_size=512, schedule_conservativeness=1.0)
    rank = build_rank(args, DP_ATTN_FOLLOWER, replica=0, runner=FakeRunner(pool_size=64), endpoints=io.endpoints)
    try:
        assert rank.dp_hook is not None and rank.scheduler.dp_hook is rank.dp_hook
        assert rank.dp_rank == 1 and not rank.leader
        assert rank.args.chunked_prefill_size == 256 and rank.args.schedule_conservativeness == 1.5
        assert args.chunked_prefill_size == 512  # the caller's args are left alone
        loop = rank.loop
        assert loop.always_step and loop.group_src == 2 and not loop.leader
        # A follower never connects to its DP rank's input: nobody is there to take a request.
        time.sleep(0.2)
        with pytest.raises(zmq.Again):
            io.inputs[1].send_multipart(encode(GetStatsReq()), flags=zmq.NOBLOCK)
        # It answers flush / stats but sends no generated tokens.
        loop.send(BatchTokenOut([ReqOutput("a", [1], False, None, 1, 1, 0)]))
        loop.send(FlushCacheOut(True, loop.dp_rank))
        assert io.output.poll(3000)
        assert decode(io.output.recv_multipart()) == FlushCacheOut(True, 1)
        assert not io.output.poll(200)
    finally:
        io.close(loop)


class _Counting:
    forward_ct = 0


def test_idle_wait_per_layout(tmp_path):
    ctx = zmq.Context()
    socks = [ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)]
    try:
        alone = SchedulerLoop(_Counting(), *socks)
        assert alone.idle_wait_ms() is None                       # one rank: wait for a message
        tp = SchedulerLoop(_Counting(), *socks, pstate=ParallelState(tp_size=2, attn_tp_size=2))
        assert tp.idle_wait_ms() == int(HEARTBEAT_S * 1000)       # TP group: heartbeat
        sched = _Counting()
        dp = SchedulerLoop(sched, *socks, always_step=True, pstate=DP_ATTN_FOLLOWER)
        assert dp.idle_wait_ms() == 0                             # first call: counts as a forward
        waits = [dp.idle_wait_ms() for _ in range(6)]
        assert waits == [IDLE_POLL_MS, 4, 8, 16, MAX_IDLE_POLL_MS, MAX_IDLE_POLL_MS]
        sched.forward_ct += 1                                     # another rank was busy
        assert dp.idle_wait_ms() == 0 and dp.idle_wait_ms() == IDLE_POLL_MS
    finally:
        for s in socks:
            s.close(0)
        ctx.term()
