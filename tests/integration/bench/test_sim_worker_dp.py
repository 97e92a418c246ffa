"""sim-worker --dp-size: each DP rank its own cache and event stream; the rank named by the request serves it."""

import asyncio
import json

import aiohttp
import msgpack
import pytest

from fleetserve.bench import sim_worker
from helpers.kv_events_sub import free_port_block, replay

FAST = ["--prefill-per-token-s", "0", "--prefill-overhead-s", "0", "--decode-base-s", "0.001",
        "--decode-per-req-s", "0", "--decode-per-ctx-token-s", "0"]


@pytest.mark.timeout(60)
async def test_two_workers_with_two_ranks_each():
    http = free_port_block(2)
    ev = free_port_block(8)
    cfg = {"publisher": "zmq", "endpoint": f"tcp://*:{ev}", "replay_endpoint": f"tcp://*:{ev + 4}", "topic": "sim",
           "encoding": "array"}
    args = sim_worker.build_parser().parse_args([
        "--port", str(http), "--num-workers", "2", "--dp-size", "2", "--kv-events-config", json.dumps(cfg), *FAST])
    ready, stop = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(sim_worker.serve(args, ready, stop))
    await asyncio.wait_for(ready.wait(), 10)
    w1 = f"http://127.0.0.1:{http + 1}"
    prompt = list(range(100, 120))
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s:
            async with s.get(w1 + "/get_server_info") as r:
                info = await r.json()
            assert info["dp_size"] == 2
            # worker 1's rank 0 publishes on ports + 1 * 2 + 0
            assert json.loads(info["kv_events_config"])["endpoint"] == f"tcp://*:{ev + 2}"

            async def gen(body=None, headers=None):
                async with s.post(w1 + "/generate", headers=headers or {},
                                  json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 2}, **(body or {})}) as r:
                    return r.status, await r.json()

            st, out = await gen({"routed_dp_rank": 1})
            assert st == 200 and out["meta_info"]["cached_tokens"] == 0
            st, out = await gen({"routed_dp_rank": 1})  # rank 1 holds it now (page size 1: all but the last)
            assert st == 200 and out["meta_info"]["cached_tokens"] == len(prompt) - 1
            st, out = await gen(headers={"X-data-parallel-rank": "0"})  # vLLM's header: rank 0, a cold cache
            assert st == 200 and out["meta_info"]["cached_tokens"] == 0
            st, out = await gen({"routed_dp_rank": 2})
            assert st == 400 and out["error"]["message"] == "routed_dp_rank=2 out of range [0, 2)"
            st, out = await gen({"routed_dp_rank": 0}, {"X-data-parallel-rank": "1"})  # the header wins: rank 1
            assert st == 200 and out["meta_info"]["cached_tokens"] == len(prompt) - 1
            async with s.get(w1 + "/v1/loads") as r:
                loads = await r.json()
            assert loads["dp_rank_count"] == 2
            assert [x["dp_rank"] for x in loads["loads"]] == [0, 1]
            async with s.get(w1 + "/metrics") as r:
                text = await r.text()
            assert f'fleetserve:num_requests_total{{worker="127.0.0.1:{http + 1}"}} 4' in text
            # rank 1's stream (ports + 3) names DP rank 1 and stored the prompt's blocks
            ans = await asyncio.to_thread(replay, f"tcp://127.0.0.1:{ev + 4 + 3}", 0)
            batches = [msgpack.unpackb(m[2]) for m in ans[:-1]]
            assert batches and all(b[2] == 1 for b in batches)
            assert batches[0][1][0][0] == "BlockStored" and batches[0][1][0][3][:len(prompt)] == prompt
            async with s.post(w1 + "/flush_cache") as r:
                assert r.status == 200
            st, out = await gen({"routed_dp_rank": 1})
            assert st == 200 and out["meta_info"]["cached_tokens"] == 0  # every rank was flushed
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
