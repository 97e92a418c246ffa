"""sim-worker answers ``/get_load``, ``/v1/loads`` and ``/get_server_info`` in the engine's (SGLang's) shapes.

The key lists below are written from SGLang's handlers (``GetLoadsReqOutput``
core fields, the older ``/get_load`` list) and are the ones
``tests/integration/entrypoints/test_serve_loads.py`` reads from ``fleetserve
serve``; the values must track the simulated engine (a running request, a
waiting one with a cached prefix, zero after). ``/get_server_info`` lets a
router find each worker's KV-event stream from its URL alone, and an aborted
streaming request's pages are published at once, though the worker is idle after.

``--loads-api vllm`` makes the worker look like a vLLM server from the load side: no
``/get_load`` or ``/v1/loads`` (FastAPI's 404), vLLM's per-engine gauges on ``/metrics``.
"""

import asyncio
import json
import time

import contextlib

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleetserve.bench import sim_worker
from fleetserve.router.kv_events.sources import endpoints_from_info
from fleetserve.router.probes import parse_load
from helpers.kv_events_sub import Subscriber, batch_of, free_port_block

LOAD_KEYS = {"dp_rank", "num_running_reqs", "num_waiting_reqs", "num_total_reqs", "num_waiting_uncached_tokens",
             "num_used_tokens", "num_total_tokens", "max_total_num_tokens", "max_running_requests", "token_usage",
             "gen_throughput", "cache_hit_rate", "utilization", "timestamp", "prefill_throughput"}
TOP_KEYS = {"timestamp", "version", "dp_rank_count", "accelerator", "num_accelerators", "loads", "aggregate"}
AGG_KEYS = {"total_running_reqs", "total_waiting_reqs", "total_reqs", "avg_token_usage", "avg_throughput",
            "avg_utilization", "total_waiting_uncached_tokens", "total_used_tokens", "total_tokens"}
LEGACY_KEYS = {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens", "num_pending_tokens", "ts_tic"}

SHARED = list(range(100, 140))  # 40 tokens


@pytest.fixture
async def sim():
    http = free_port_block(2)
    ev = free_port_block(4)
    cfg = {"publisher": "zmq", "endpoint": f"tcp://*:{ev}", "replay_endpoint": f"tcp://*:{ev + 2}", "topic": "sim"}
    args = sim_worker.build_parser().parse_args([
        "--port", str(http), "--num-workers", "2", "--kv-events-config", json.dumps(cfg),
        "--max-running-requests", "1", "--max-total-tokens", "4096",
        "--prefill-per-token-s", "0", "--prefill-overhead-s", "0", "--decode-base-s", "0.02",
        "--decode-per-req-s", "0", "--decode-per-ctx-token-s", "0"])
    ready, stop = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(sim_worker.serve(args, ready, stop))
    await asyncio.wait_for(ready.wait(), 10)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            yield s, http, ev
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


async def _get(s, url):
    async with s.get(url) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def _generate(s, url, ids, n):
    async with s.post(url + "/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": n}}) as r:
        assert r.status == 200
        return await r.json()


async def _wait_load(s, url, cond, timeout=10.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        body = await _get(s, url + "/v1/loads")
        if cond(body["loads"][0]):
            return body
        assert asyncio.get_running_loop().time() < deadline, body
        await asyncio.sleep(0.01)


@pytest.mark.timeout(60)
async def test_loads_in_the_engines_shapes_track_the_simulated_engine(sim):
    s, http, _ = sim
    url = f"http://127.0.0.1:{http}"
    idle = await _get(s, url + "/v1/loads")
    assert set(idle) == TOP_KEYS and set(idle["aggregate"]) == AGG_KEYS
    assert idle["dp_rank_count"] == 1 and idle["num_accelerators"] == 1
    (d,) = idle["loads"]
    assert set(d) == LOAD_KEYS
    assert abs(d["timestamp"] - time.time()) < 60  # taken just now, seconds since the epoch
    assert d["max_total_num_tokens"] == 4096 and d["max_running_requests"] == 1
    assert {k: d[k] for k in ("num_running_reqs", "num_waiting_reqs", "num_used_tokens", "num_total_tokens")} == {
        "num_running_reqs": 0, "num_waiting_reqs": 0, "num_used_tokens": 0, "num_total_tokens": 0}
    legacy = await _get(s, url + "/get_load")
    assert [set(x) for x in legacy] == [LEGACY_KEYS] and parse_load(legacy) == 0  # the router reads it

    await _generate(s, url, SHARED + [1, 2], 2)  # caches SHARED + 2 (+ 1 output) tokens
    # one long request runs (max 1 running); a second with the cached prefix waits
    run = asyncio.create_task(_generate(s, url, [7, 8, 9, 10], 60))
    await _wait_load(s, url, lambda d: d["num_running_reqs"] == 1)
    wait = asyncio.create_task(_generate(s, url, SHARED + [3, 4, 5], 2))
    body = await _wait_load(s, url, lambda d: d["num_waiting_reqs"] == 1)
    d = body["loads"][0]
    assert d["num_total_reqs"] == 2 and body["aggregate"]["total_reqs"] == 2
    assert d["num_waiting_uncached_tokens"] == 3  # the 40 shared tokens are cached
    assert d["num_used_tokens"] > 0 and d["num_total_tokens"] == d["num_used_tokens"] + len(SHARED) + 3
    legacy = await _get(s, url + "/get_load")
    assert legacy[0]["num_reqs"] == 2 and legacy[0]["num_pending_tokens"] == len(SHARED) + 3
    assert parse_load(legacy) == legacy[0]["num_tokens"] > 0
    await asyncio.gather(run, wait)
    d = (await _wait_load(s, url, lambda d: d["num_total_reqs"] == 0))["loads"][0]
    assert d["num_used_tokens"] == d["num_total_tokens"] == d["num_waiting_uncached_tokens"] == 0
    assert 0 < d["cache_hit_rate"] < 1 and d["gen_throughput"] > 0
    # SGLang's query parameters, the same answers as the engine's
    async with s.get(url + "/v1/loads?dp_rank=1") as r:
        assert r.status == 400 and (await r.json())["error"]["param"] == "dp_rank"
    async with s.get(url + "/v1/loads?include=bogus") as r:
        assert r.status == 400 and (await r.json())["error"]["param"] == "include"
    async with s.get(url + "/v1/loads?format=prometheus&dp_rank=0") as r:
        assert r.status == 200 and 'sglang_num_running_reqs{dp_rank="0"} 0.0' in await r.text()


@pytest.mark.timeout(60)
async def test_server_info_finds_each_workers_stream_and_an_abort_publishes_at_once(sim):
    s, http, ev = sim
    for w in (0, 1):
        info = await _get(s, f"http://127.0.0.1:{http + w}/get_server_info")
        assert isinstance(info["kv_events_config"], str)  # JSON text, as SGLang reports it
        assert info["page_size"] == 1 and info["dp_size"] == 1 and info["enable_dp_attention"] is False
        assert endpoints_from_info(info, f"http://127.0.0.1:{http + w}") == [
            (0, f"tcp://127.0.0.1:{ev + w}", f"tcp://127.0.0.1:{ev + 2 + w}", "sim")]
    url = f"http://127.0.0.1:{http + 1}"
    sub = Subscriber(f"tcp://127.0.0.1:{ev + 1}", b"sim")
    try:
        for _ in range(100):  # flush until the subscription has arrived (ZMQ's slow joiner)
            async with s.post(url + "/flush_cache") as r:
                assert r.status == 200
            if await asyncio.to_thread(sub.recv, 0.1) is not None:
                break
        else:
            pytest.fail("subscriber never connected")
        await asyncio.to_thread(sub.drain, 0.2)
        prompt = [5, 6, 7, 8]
        body = {"input_ids": prompt, "stream": True, "sampling_params": {"max_new_tokens": 1000}}  # 20 s
        async with s.post(url + "/generate", json=body) as r:
            n = 0
            async for line in r.content:  # a few chunks, then hang up
                n += line.startswith(b"data: ")
                if n == 5:
                    break
        m = await asyncio.to_thread(sub.recv, 5.0)
        assert m is not None, "the prompt's page was never published"
        (first,) = batch_of(m)[1]
        assert first["type"] == "BlockStored" and first["token_ids"] == prompt
        # the abort hands prompt + outputs to the tree: published without any later request
        m = await asyncio.to_thread(sub.recv, 3.0)
        assert m is not None, "the aborted request's pages were never published"
        (ev2,) = batch_of(m)[1]
        assert ev2["type"] == "BlockStored" and ev2["parent_block_hash"] == first["block_hashes"][-1]
        assert len(ev2["token_ids"]) >= 4
        d = (await _wait_load(s, url, lambda d: d["num_total_reqs"] == 0))["loads"][0]
        assert d["num_used_tokens"] == 0
    finally:
        sub.close()


# --loads-api vllm: 2 DP ranks of 62 pages of 16 tokens (1000 tokens round down to 992), one request
# running at a time per rank, 50 ms decode steps (200 tokens: 10 s, long enough to look at it)
VLLM_ARGV = ["--dp-size", "2", "--max-total-tokens", "1000", "--page-size", "16", "--chunked-prefill-size", "64",
             "--max-running-requests", "1", "--model-name", "sim-vllm",
             "--prefill-per-token-s", "0", "--prefill-overhead-s", "0", "--decode-base-s", "0.05",
             "--decode-per-req-s", "0", "--decode-per-ctx-token-s", "0"]
PAGE, POOL = 16, 992
VLLM_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


@contextlib.asynccontextmanager
async def _one_worker(argv):
    """One sim-worker on a free port with ``argv``: ``(session, url)``."""
    args = sim_worker.build_parser().parse_args(["--port", "0", *argv])
    ready, stop = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(sim_worker.serve(args, ready, stop))
    await asyncio.wait_for(ready.wait(), 10)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            yield s, f"http://127.0.0.1:{args.port}"
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


async def _vllm_series(s, url) -> dict:
    """``/metrics``' vllm:* samples, parsed as Prometheus text: ``{name: {engine: sample}}``, each
    (name, engine) pair asserted to appear once."""
    async with s.get(url + "/metrics") as r:
        assert r.status == 200
        text = await r.text()
    out: dict = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            if smp.name.startswith("vllm:"):
                per = out.setdefault(smp.name, {})
                assert smp.labels["engine"] not in per, (smp.name, smp.labels)
                per[smp.labels["engine"]] = smp
    return out


async def _rank_stats(s, url) -> list:
    return (await _get(s, url + "/get_server_info"))["scheduler_stats"]


@pytest.mark.timeout(60)
async def test_vllm_loads_api_answers_404_for_the_sglang_routes_and_vllm_gauges_per_rank():
    async with _one_worker(["--loads-api", "vllm", *VLLM_ARGV]) as (s, url):
        for path in ("/v1/loads", "/get_load", "/v1/loads?include=core"):
            async with s.get(url + path) as r:
                assert r.status == 404 and r.headers["Content-Type"] == "application/json"
                assert await r.read() == b'{"detail":"Not Found"}'  # FastAPI's body, byte for byte
        info = await _get(s, url + "/get_server_info")  # unchanged: the router still finds its fields
        assert info["page_size"] == PAGE and info["dp_size"] == 2
        assert [x["kv_pool_size"] for x in info["scheduler_stats"]] == [POOL, POOL]

        idle = await _vllm_series(s, url)
        for name in (*VLLM_GAUGES, "vllm:cache_config_info"):
            assert set(idle[name]) == {"0", "1"}, name
        for name in VLLM_GAUGES:
            for r in ("0", "1"):
                assert idle[name][r].labels == {"model_name": "sim-vllm", "engine": r}
                assert idle[name][r].value == 0.0
        for r in ("0", "1"):
            cfg = idle["vllm:cache_config_info"][r]
            assert "model_name" not in cfg.labels and cfg.value == 1.0
            assert cfg.labels["block_size"] == str(PAGE)
            assert cfg.labels["num_gpu_blocks"] == str(POOL // PAGE + 1) == "63"  # + vLLM's null block
            assert cfg.labels["cache_dtype"] == "auto" and cfg.labels["enable_prefix_caching"] == "True"

        # rank 1: one request runs (it reserves 20 prompt + 200 output tokens: 14 whole pages), a second waits
        body = {"input_ids": list(range(100, 120)), "stream": True, "routed_dp_rank": 1,
                "sampling_params": {"max_new_tokens": 200}}
        async with s.post(url + "/generate", json=body) as r:
            assert r.status == 200
            async for line in r.content:  # the first token: prefilled, now decoding
                if line.startswith(b"data: "):
                    break
            async def short(rank):
                async with s.post(url + "/generate", json={"input_ids": [5, 6, 7], "routed_dp_rank": rank,
                                                           "sampling_params": {"max_new_tokens": 2}}) as r:
                    assert r.status == 200

            await short(0)  # rank 0 is free: served at once, its pages left cached (evictable)
            queued = asyncio.create_task(short(1))  # rank 1 runs one at a time: this one waits
            deadline = asyncio.get_running_loop().time() + 10
            while (await _rank_stats(s, url))[1]["num_waiting_reqs"] != 1:
                assert asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.01)
            before = await _rank_stats(s, url)
            m = await _vllm_series(s, url)
            after = await _rank_stats(s, url)
            queued.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await queued
        used = 14 * PAGE
        assert before[1]["kv_used_tokens"] == after[1]["kv_used_tokens"] == used  # held while it runs
        assert {r: m["vllm:num_requests_running"][r].value for r in ("0", "1")} == {"0": 0.0, "1": 1.0}
        assert {r: m["vllm:num_requests_waiting"][r].value for r in ("0", "1")} == {"0": 0.0, "1": 1.0}
        usage = m["vllm:kv_cache_usage_perc"]["1"].value
        assert usage == used / POOL == before[1]["kv_used_tokens"] / before[1]["kv_pool_size"]
        # as vLLM computes it from the blocks: 1 - free / (num_gpu_blocks - 1)
        blocks = int(m["vllm:cache_config_info"]["1"].labels["num_gpu_blocks"])
        assert usage == pytest.approx(1 - (POOL // PAGE - 14) / (blocks - 1))
        assert m["vllm:kv_cache_usage_perc"]["0"].value == 0.0  # rank 0's answer is cached, evictable: free


@pytest.mark.timeout(60)
async def test_default_loads_api_keeps_the_sglang_routes_and_no_vllm_series():
    async with _one_worker(VLLM_ARGV) as (s, url):
        body = await _get(s, url + "/v1/loads")
        assert body["dp_rank_count"] == 2 and [d["dp_rank"] for d in body["loads"]] == [0, 1]
        assert [set(x) for x in await _get(s, url + "/get_load")] == [LEGACY_KEYS, LEGACY_KEYS]
        async with s.get(url + "/metrics") as r:
            text = await r.text()
        assert "fleetserve:num_requests_total" in text and "vllm:" not in text
