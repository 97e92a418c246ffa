"""KV events from the scheduler: what the radix cache reports, one publisher per DP rank on port + rank."""

import json

import pytest
import zmq

from fleetserve.distributed.parallel_state import SINGLE_RANK_STATE, ParallelState
from fleetserve.engine.args import ServerArgs
from fleetserve.engine.io_struct import TokenizedGenerateReq
from fleetserve.engine.rank_builder import build_rank
from fleetserve.engine.sampling_params import SamplingParams
from helpers.fake_runner import FakeRunner
from helpers.kv_events_sub import Subscriber, batch_of, free_port_block, wait_connected
from helpers.scheduler_driver import run_to_completion


def _args(port, **kw):
    cfg = {"publisher": "zmq", "endpoint": f"tcp://*:{port}", "topic": "kv"}
    cfg.update(kw.pop("events", {}))
    return ServerArgs(random_seed=0, kv_events_config=json.dumps(cfg), dp_size=2, **kw)


def _req(rid, prompt, n=3):
    return TokenizedGenerateReq(rid, list(prompt), SamplingParams(max_new_tokens=n, ignore_eos=True))


def _events(sub):
    out = []
    for m in sub.drain(0.5):
        out.extend(batch_of(m)[1])
    return out


def test_two_dp_ranks_publish_on_base_port_plus_rank(tmp_path):
    base = free_port_block(2)
    ranks = [build_rank(_args(base), SINGLE_RANK_STATE, replica=r, runner=FakeRunner(pool_size=64)) for r in (0, 1)]
    subs = [Subscriber(f"tcp://127.0.0.1:{base + r}", b"kv") for r in (0, 1)]
    try:
        pubs = [rk.scheduler.event_sink for rk in ranks]
        assert [p.endpoint for p in pubs] == [f"tcp://*:{base}", f"tcp://*:{base + 1}"]
        for p, s in zip(pubs, subs):
            wait_connected(p, s)
        prompts = {0: [1, 2, 3, 4], 1: [9, 8, 7]}
        for r in (0, 1):
            run_to_completion(ranks[r].scheduler, [_req(f"r{r}", prompts[r])])
        for r in (0, 1):
            msgs = subs[r].drain(0.5)
            assert msgs and all(batch_of(m)[2] == r for m in msgs)  # data_parallel_rank in every batch
            stored = [e for m in msgs for e in batch_of(m)[1] if e["type"] == "BlockStored"]
            # the prompt after its prefill, then prompt + output[:-1] at the end: one chain
            assert stored[0]["token_ids"] == prompts[r] and stored[0]["parent_block_hash"] is None
            assert stored[0]["block_size"] == 1 and len(stored[0]["block_hashes"]) == len(prompts[r])
            assert len(stored) == 2 and len(stored[1]["token_ids"]) == 2  # 3 generated, the last not cached
            assert stored[1]["parent_block_hash"] == stored[0]["block_hashes"][-1]
            st = ranks[r].scheduler.get_stats()
            assert st.kv_events_published == pubs[r].published and st.kv_events_dropped == 0
    finally:
        for s in subs:
            s.close()
        for rk in ranks:
            rk.scheduler.event_sink.shutdown()


def test_eviction_and_flush_are_reported_with_the_stored_hashes():
    base = free_port_block(1)
    rank = build_rank(_args(base, events={"encoding": "map"}, max_total_tokens=16), SINGLE_RANK_STATE,
                      runner=FakeRunner(pool_size=16))
    sub = Subscriber(f"tcp://127.0.0.1:{base}", b"kv")
    pub = rank.scheduler.event_sink
    try:
        wait_connected(pub, sub)
        sched = rank.scheduler
        run_to_completion(sched, [_req("a", [1, 2, 3, 4, 5, 6, 7, 8], n=2)])
        first = _events(sub)
        held = {h for e in first if e["type"] == "BlockStored" for h in e["block_hashes"]}
        assert len(held) == 9  # 8 prompt tokens + 1 computed output token
        run_to_completion(sched, [_req("b", [20, 21, 22, 23, 24, 25, 26, 27, 28, 29], n=2)])  # needs eviction
        second = _events(sub)
        removed = [h for e in second if e["type"] == "BlockRemoved" for h in e["block_hashes"]]
        assert removed and set(removed) <= held
        assert sched.flush_cache()
        assert _events(sub) == [{"type": "AllBlocksCleared"}]
    finally:
        sub.close()
        pub.shutdown()


def test_dp_attention_leaders_publish_followers_do_not():
    base = free_port_block(2)
    leader1 = ParallelState(tp_rank=2, tp_size=4, attn_tp_rank=0, attn_tp_size=2, attn_dp_rank=1, attn_dp_size=2)
    follower1 = ParallelState(tp_rank=3, tp_size=4, attn_tp_rank=1, attn_tp_size=2, attn_dp_rank=1, attn_dp_size=2)
    args = _args(base, tp_size=4, enable_dp_attention=True)
    lead = build_rank(args, leader1, runner=FakeRunner(pool_size=64))
    follow = build_rank(args, follower1, runner=FakeRunner(pool_size=64))
    try:
        assert lead.dp_rank == 1 and lead.scheduler.event_sink.endpoint == f"tcp://*:{base + 1}"
        assert lead.scheduler.event_sink.data_parallel_rank == 1
        assert follow.scheduler.event_sink is None and follow.scheduler.cache.event_sink is None
    finally:
        lead.scheduler.event_sink.shutdown()


def test_busy_port_fails_the_rank_build_with_one_line():
    base = free_port_block(1)
    ctx = zmq.Context()
    holder = ctx.socket(zmq.PUB)
    holder.bind(f"tcp://*:{base}")
    try:
        with pytest.raises(ValueError, match=f"^--kv-events-config: endpoint 'tcp://\\*:{base}': cannot bind"):
            build_rank(_args(base), SINGLE_RANK_STATE, runner=FakeRunner(pool_size=64))
    finally:
        holder.close(0)
        ctx.term()


def test_no_config_no_publisher_and_disabled_cache_reports_nothing():
    rank = build_rank(ServerArgs(random_seed=0), SINGLE_RANK_STATE, runner=FakeRunner(pool_size=64))
    assert rank.scheduler.event_sink is None and rank.scheduler.cache.event_sink is None
    base = free_port_block(1)
    rank = build_rank(_args(base, disable_radix_cache=True), SINGLE_RANK_STATE, runner=FakeRunner(pool_size=64))
    try:
        assert rank.scheduler.cache.event_sink is None
        run_to_completion(rank.scheduler, [_req("a", [1, 2, 3])])
        assert rank.scheduler.event_sink.next_seq == 0
    finally:
        rank.scheduler.event_sink.shutdown()


class _Recorder:
    def __init__(self):
        self.calls = []

    def block_stored(self, block_hashes, parent_block_hash, token_ids, block_size):
        self.calls.append(("stored", block_hashes, parent_block_hash, token_ids, block_size))

    def block_removed(self, block_hashes):
        self.calls.append(("removed", block_hashes))

    def all_blocks_cleared(self):
        self.calls.append(("cleared",))


def test_radix_cache_sink_calls_follow_the_tree():
    from fleetserve.engine.radix_cache import RadixCache

    rec = _Recorder()
    cache = RadixCache(32, event_sink=rec)
    a = cache.allocator.alloc(4)
    assert cache.insert([1, 2, 3, 4], a) == 0
    b = cache.allocator.alloc(3)
    assert cache.insert([1, 2, 9], b) == 2  # splits [1, 2 | 3, 4]; only [9] is new
    cache.allocator.free(b[:2])
    (_, h1, p1, t1, bs1), (_, h2, p2, t2, _) = rec.calls
    assert (p1, t1, bs1, len(h1)) == (None, [1, 2, 3, 4], 1, 4) and len(set(h1)) == 4
    assert (p2, t2, len(h2)) == (h1[1], [9], 1)  # the chain continues after token 2
    # the same prefix gives the same hashes (a later insert after eviction re-reports them alike)
    rec.calls.clear()
    assert cache.evict(100) == 5
    removed = [h for c in rec.calls for h in c[1]]
    assert sorted(removed) == sorted(h1 + h2) and all(c[0] == "removed" for c in rec.calls)
    rec.calls.clear()
    c = cache.allocator.alloc(2)
    cache.insert([1, 2], c)
    assert rec.calls == [("stored", h1[:2], None, [1, 2], 1)]
    cache.reset()
    assert rec.calls[-1] == ("cleared",)
    assert cache.allocator.available_size() == 32
