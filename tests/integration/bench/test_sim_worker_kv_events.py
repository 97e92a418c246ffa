"""sim-worker --kv-events-config: each worker's real radix cache publishes on the endpoint ports + worker index."""

import asyncio
import json

import aiohttp
import msgpack
import pytest

from fleetserve.bench import sim_worker
from helpers.kv_events_sub import Subscriber, batch_of, free_port_block, replay


@pytest.mark.timeout(60)
async def test_workers_publish_their_cache_events():
    http = free_port_block(2)
    ev = free_port_block(4)
    cfg = {"publisher": "zmq", "endpoint": f"tcp://*:{ev}", "replay_endpoint": f"tcp://*:{ev + 2}",
           "encoding": "array", "topic": "sim"}
    args = sim_worker.build_parser().parse_args([
        "--port", str(http), "--num-workers", "2", "--kv-events-config", json.dumps(cfg),
        "--prefill-per-token-s", "0", "--prefill-overhead-s", "0", "--decode-base-s", "0.001",
        "--decode-per-req-s", "0", "--decode-per-ctx-token-s", "0"])
    ready, stop = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(sim_worker.serve(args, ready, stop))
    await asyncio.wait_for(ready.wait(), 10)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s:
            for w, prompt in ((0, [5, 6, 7, 8]), (1, [9, 10, 11])):
                async with s.post(f"http://127.0.0.1:{http + w}/generate",
                                  json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 3}}) as r:
                    assert r.status == 200
            for w, prompt in ((0, [5, 6, 7, 8]), (1, [9, 10, 11])):
                # the subscriber may join late (slow joiner), so read the worker's replay buffer from 0
                ans = await asyncio.to_thread(replay, f"tcp://127.0.0.1:{ev + 2 + w}", 0)
                batches = [msgpack.unpackb(m[2]) for m in ans[:-1]]
                assert [int.from_bytes(m[1], "big") for m in ans[:-1]] == list(range(len(batches)))
                assert all(b[2] == 0 for b in batches)  # each worker is its own instance: DP rank 0
                first = batches[0][1][0]
                assert first[0] == "BlockStored" and first[3] == prompt and first[2] is None and first[6] == "GPU"
                async with s.get(f"http://127.0.0.1:{http + w}/metrics") as r:
                    text = await r.text()
                assert f'fleetserve:kv_events_published_total{{worker="127.0.0.1:{http + w}"}} {len(batches)}' in text
            # a live subscriber sees the flush
            sub = Subscriber(f"tcp://127.0.0.1:{ev}", b"sim")
            try:
                for _ in range(100):  # keep flushing until the subscription has arrived
                    async with s.post(f"http://127.0.0.1:{http}/flush_cache") as r:
                        assert r.status == 200
                    m = await asyncio.to_thread(sub.recv, 0.1)
                    if m is not None:
                        break
                assert m is not None and m[0] == b"sim" and batch_of(m)[1] == [["AllBlocksCleared"]]
            finally:
                sub.close()
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


@pytest.mark.timeout(60)
async def test_out_of_range_token_ids_get_the_engines_400_and_the_worker_keeps_serving():
    """Token ids the page hash cannot take (negative, >= 2**32) once stopped the engine loop silently
    and hung that request and every later one: now the engine's 400, and the next request is served."""
    http = free_port_block(1)
    ev = free_port_block(2)
    cfg = {"publisher": "zmq", "endpoint": f"tcp://*:{ev}", "replay_endpoint": f"tcp://*:{ev + 1}"}
    args = sim_worker.build_parser().parse_args([
        "--port", str(http), "--kv-events-config", json.dumps(cfg), "--page-size", "1",
        "--prefill-per-token-s", "0", "--prefill-overhead-s", "0", "--decode-base-s", "0.001",
        "--decode-per-req-s", "0", "--decode-per-ctx-token-s", "0"])
    ready, stop = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(sim_worker.serve(args, ready, stop))
    await asyncio.wait_for(ready.wait(), 10)
    base = f"http://127.0.0.1:{http}"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s:
            for path, body, param, bad in (
                    ("/v1/completions", {"prompt": [-1, 2], "max_tokens": 2}, "prompt", -1),
                    ("/v1/completions", {"prompt": [3, 1 << 32], "max_tokens": 2}, "prompt", 1 << 32),
                    ("/generate", {"input_ids": [7, 1 << 40], "sampling_params": {"max_new_tokens": 2}},
                     "input_ids", 1 << 40)):
                async with s.post(base + path, json=body) as r:
                    assert r.status == 400, await r.text()
                    err = (await r.json())["error"]
                assert err["param"] == param and f"token id {bad} " in err["message"]
                assert "outside the vocabulary" in err["message"]
            async with s.get(base + "/health") as r:
                assert r.status == 200
            async with s.post(base + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2}) as r:
                assert r.status == 200
                assert (await r.json())["usage"]["completion_tokens"] == 2
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
