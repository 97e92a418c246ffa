"""kv_aware's engine loads from a vLLM worker: no ``/v1/loads``, so the router reads vLLM's scheduler
gauges on ``GET /metrics`` (loads.vllm_figures) and counts them as the running requests' KV alone."""

import contextlib
import math
import time
from types import SimpleNamespace

from aiohttp import web

from fleetserve.router.kv_events.decode import BlockStored
from fleetserve.router.kv_events.loads import EngineLoads, vllm_figures
from fleetserve.router.kv_events.policy import KvAwarePolicy, RouteKey
from fleetserve.router.workers import Worker

A, B = "http://a:1", "http://b:1"
P = list(range(1000, 1400))  # 100 blocks of 4 cached on A


@contextlib.asynccontextmanager
async def polled(start_app, *route_sets, urls: list | None = None):
    """Workers answering ``{path: handler}`` each (GET), and a router stub whose registry lists them:
    yields ``(worker urls, router)``.  ``urls``: a list the registry reads (a test may empty it)."""
    import aiohttp

    runners, found = [], []
    try:
        for routes in route_sets:
            app = web.Application()
            for path, handler in routes.items():
                app.router.add_get(path, handler)
            runner, url = await start_app(app)
            runners.append(runner)
            found.append(url)
        listed = found if urls is None else urls
        if urls is not None:
            urls.extend(found)
        async with aiohttp.ClientSession() as session:
            yield found, SimpleNamespace(session=session, own_headers=lambda url: {},
                                         registry=SimpleNamespace(urls=lambda: list(listed)))
    finally:
        for runner in runners:
            await runner.cleanup()


def serve(text: str, gate=None):
    """A ``/metrics`` handler answering ``text`` (after ``gate`` is set, when given)."""
    async def metrics(_req):
        if gate is not None:
            await gate.wait()
        return web.Response(text=text, content_type="text/plain")
    return metrics


async def not_found(_req):
    return web.json_response({"detail": "Not Found"}, status=404)


async def until(cond, tries: int = 100) -> None:
    """Let the loop run in 10 ms steps until, after a step, ``cond()`` holds, or ``tries`` steps have passed."""
    import asyncio

    for _ in range(tries):
        await asyncio.sleep(0.01)
        if cond():
            return


def info(engine: str, blocks: str = "1001", size: str = "16") -> str:
    """``vllm:cache_config_info`` as vLLM's ``log_metrics_info`` sets it: every CacheConfig field as a string
    label (``metrics_info()``), then ``engine``; no ``model_name``."""
    return ("vllm:cache_config_info{block_size=\"%s\",cache_dtype=\"auto\",calculate_kv_scales=\"False\","
            "cpu_offload_gb=\"0\",enable_prefix_caching=\"True\",gpu_memory_utilization=\"0.9\","
            "is_attention_free=\"False\",num_cpu_blocks=\"None\",num_gpu_blocks=\"%s\","
            "num_gpu_blocks_override=\"None\",prefix_caching_hash_algo=\"sha256\",sliding_window=\"None\","
            "swap_space=\"4\",engine=\"%s\"} 1.0" % (size, blocks, engine))


# Two DP engines behind one vLLM API server, laid out as prometheus_client renders vLLM v1's
# PrometheusStatLogger (labels model_name, engine); histogram and counter lines around the gauges, and
# newer vLLM's num_requests_waiting_by_reason, which must not be read as num_requests_waiting.
VLLM_METRICS = "\n".join([
    "# HELP vllm:num_requests_running Number of requests in model execution batches.",
    "# TYPE vllm:num_requests_running gauge",
    'vllm:num_requests_running{engine="0",model_name="m"} 5.0',
    'vllm:num_requests_running{engine="1",model_name="m"} 2.0',
    "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
    "# TYPE vllm:num_requests_waiting gauge",
    'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0',
    'vllm:num_requests_waiting{engine="1",model_name="m"} 0.0',
    "# HELP vllm:num_requests_waiting_by_reason Number of requests waiting, by reason.",
    "# TYPE vllm:num_requests_waiting_by_reason gauge",
    'vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 99.0',
    "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
    "# TYPE vllm:kv_cache_usage_perc gauge",
    'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25',
    'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5',
    "# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.",
    "# TYPE vllm:prefix_cache_queries_total counter",
    'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 123456.0',
    "# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.",
    "# TYPE vllm:time_to_first_token_seconds histogram",
    'vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="m"} 0.0',
    'vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 40.0',
    'vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 40.0',
    'vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 3.5',
    "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
    "# TYPE vllm:cache_config_info gauge",
    info("0"),
    info("1"),
]) + "\n"


def test_vllm_figures_reads_each_engines_running_kv_waiting_requests_and_pool():
    """usage x (num_gpu_blocks - 1) x block_size: 0.25 x 1000 x 16 = 4000 and 0.5 x 16000 = 8000 tokens;
    the pools are 16000 (vLLM's null block is not in them); waiting 3 and 0 (not the by-reason 99)."""
    assert vllm_figures(VLLM_METRICS) == ({0: 4000, 1: 8000}, {0: 3, 1: 0}, {0: 16000, 1: 16000})


def test_vllm_figures_takes_the_older_usage_name_and_prefers_the_new_one():
    old = VLLM_METRICS.replace("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
    assert vllm_figures(old)[0] == {0: 4000, 1: 8000}
    both = VLLM_METRICS + 'vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.75\n'
    assert vllm_figures(both)[0] == {0: 4000, 1: 8000}


def test_vllm_figures_without_usable_figures_is_none():
    assert vllm_figures("") is None
    assert vllm_figures("not prometheus at all\n{}\n") is None
    # SGLang's and our own /metrics have no vllm: gauges
    assert vllm_figures('sglang:num_used_tokens{model_name="m"} 10.0\nfleetserve:num_waiting_reqs 1\n') is None
    no_info = "\n".join(ln for ln in VLLM_METRICS.splitlines() if not ln.startswith("vllm:cache_config_info"))
    assert vllm_figures(no_info) is None  # usage alone cannot be put in tokens
    assert vllm_figures(VLLM_METRICS.replace('num_gpu_blocks="1001"', 'num_gpu_blocks="None"')) is None


def test_vllm_figures_skips_bad_values_and_reads_crlf_and_unlabelled_lines():
    nan = VLLM_METRICS.replace('engine="1",model_name="m"} 0.5', 'engine="1",model_name="m"} NaN')
    assert vllm_figures(nan) == ({0: 4000}, {0: 3}, {0: 16000})
    over = VLLM_METRICS.replace('engine="1",model_name="m"} 0.5', 'engine="1",model_name="m"} 1.5')
    assert vllm_figures(over)[0] == {0: 4000}
    bad_rank = VLLM_METRICS.replace('engine="1"', 'engine="x"')
    assert vllm_figures(bad_rank)[0] == {0: 4000}
    assert vllm_figures(VLLM_METRICS.replace("\n", "\r\n")) == vllm_figures(VLLM_METRICS)
    # one engine, no engine label at all: rank 0
    single = ("vllm:kv_cache_usage_perc 0.125\nvllm:num_requests_waiting 2\n"
              'vllm:cache_config_info{block_size="16",num_gpu_blocks="101"} 1.0\n')
    assert vllm_figures(single) == ({0: 200}, {0: 2}, {0: 1600})


def test_vllm_figures_of_an_unparsable_line_is_none_not_an_exception():
    assert vllm_figures('vllm:kv_cache_usage_perc{engine="0" 0.25\n' + info("0") + "\n") is None


async def test_a_worker_without_v1_loads_is_polled_at_its_vllm_metrics(start_app):
    """The first poll finds no /v1/loads and reads /metrics in the same poll; later polls ask /metrics
    only.  When /metrics stops having the gauges, the worker counts as having neither."""
    hits = {"loads": 0, "metrics": 0}
    page = {"text": VLLM_METRICS}

    async def loads(req):
        hits["loads"] += 1
        return await not_found(req)

    async def metrics(_req):
        hits["metrics"] += 1
        return web.Response(text=page["text"], content_type="text/plain")

    async with polled(start_app, {"/v1/loads": loads, "/metrics": metrics}) as ([url], router):
        el = EngineLoads(0.5)
        await el.poll(router)
        assert hits == {"loads": 1, "metrics": 1}
        assert el.tokens(url, None) == 12000 and el.tokens(url, 1) == 8000
        assert el.queued(url, None) is None  # vLLM reports no waiting tokens
        assert el.waiting_reqs[url] == {0: 3, 1: 0} and el.capacity(url, None) == 32000
        assert url in el.running_only and (el.polls, el.failures) == (1, 0)
        await el.poll(router)
        assert hits == {"loads": 1, "metrics": 2}
        page["text"] = "# nothing here\n"
        await el.poll(router)
        assert url not in el.snapshots and url not in el.running_only and el.failures == 1
        await el.poll(router)  # asked again only after RETRY_MISSING_S
        assert hits == {"loads": 1, "metrics": 3} and el.polls == 3


def kv():
    pol = KvAwarePolicy(speculative_ttl_s=0)
    for url in (A, B):
        pol.subs[url] = {0: SimpleNamespace(state="exact")}
    pol.index.apply((A, 0), BlockStored(list(range(100)), None, P, 4))
    return pol


def test_a_running_only_figure_takes_off_the_running_union_but_not_waiting_prefixes():
    """Two of this router's hits on A's 400 cached tokens run (vLLM holds the 400 once), a third still
    waits (vLLM's usage does not count it at all).  From an SGLang-style figure of 5000 the router takes
    off 400 + 400; from vLLM's, 400 only: the waiting request's prefix is in no vLLM figure."""
    pol = kv()
    el = pol.engine_loads = EngineLoads(1.0)
    keys = [RouteKey("", P + [i], 8) for i in range(3)]
    for k in keys:
        assert pol.select([Worker(A), Worker(B)], k).url == A and k.cached == 400
    pol.prefilled(keys[0])
    pol.prefilled(keys[1])
    now = time.monotonic() + 0.001
    el.put(A, {0: 5000}, now)
    assert pol.load_term(A, None, now) == 4200
    el.put(A, {0: 5000}, now, running_only=True)
    assert A in el.running_only
    assert pol.load_term(A, None, now) == 4600
    el.put(A, {0: 5000}, now)  # a later /v1/loads answer counts waiting requests again
    assert A not in el.running_only and pol.load_term(A, None, now) == 4200
    assert math.isclose(pol.load_weight, 0.1)


def test_a_page_with_more_gauge_lines_than_any_vllm_server_has_is_not_parsed():
    from fleetserve.router.kv_events import loads

    def page(extra):  # the 6 gauge lines vllm_figures reads in VLLM_METRICS, and `extra` more
        return VLLM_METRICS + "".join('vllm:num_requests_waiting{engine="%d"} 1\n' % (9 + i) for i in range(extra))

    assert vllm_figures(page(loads.MAX_GAUGE_LINES - 6))[0] == {0: 4000, 1: 8000}  # at the cap: read
    assert vllm_figures(page(loads.MAX_GAUGE_LINES - 5)) is None


async def test_a_metrics_page_over_the_size_cap_is_not_read_and_warned_once(start_app, monkeypatch, caplog):
    from fleetserve.router.kv_events import loads

    monkeypatch.setattr(loads, "METRICS_MAX_BYTES", len(VLLM_METRICS) - 1)
    async with polled(start_app, {"/metrics": serve(VLLM_METRICS)}) as ([url], router):
        el = EngineLoads(0.5)
        with caplog.at_level("WARNING", logger="fleetserve.router"):
            await el.poll(router)
            el._missing.clear()  # ask again at once
            await el.poll(router)
        assert url not in el.snapshots and el.failures == 2
        assert sum("is over" in r.getMessage() for r in caplog.records) == 1
        monkeypatch.setattr(loads, "METRICS_MAX_BYTES", len(VLLM_METRICS))
        el._missing.clear()
        await el.poll(router)  # exactly at the cap: read
        assert el.tokens(url, None) == 12000


def big_vllm_page(engines: int = 8) -> str:
    """A page in vLLM's order: the scheduler gauges first, hundreds of histogram lines, and
    ``vllm:cache_config_info`` last (vLLM registers it once the engine is initialized)."""
    head = []
    for e in range(engines):
        head += ['vllm:num_requests_waiting{engine="%d",model_name="m"} 1.0' % e,
                 'vllm:kv_cache_usage_perc{engine="%d",model_name="m"} 0.25' % e]
    hist = ['vllm:request_latency_%d_seconds_bucket{engine="%d",le="%d.0",model_name="m"} 7.0' % (h, e, b)
            for h in range(30) for e in range(engines) for b in range(20)]
    return "\n".join(head + hist + [info(str(e)) for e in range(engines)]) + "\n"


async def test_a_page_sent_in_small_pieces_with_the_cache_config_last_is_read_whole(start_app):
    """A trial found only the first buffered chunk read (aiohttp's read(n) returns what has arrived):
    a vLLM page of 300+ KB, cache_config_info at its end, gave no figure."""
    import asyncio

    page = big_vllm_page().encode()
    assert len(page) > 300_000

    async def metrics(req):
        resp = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await resp.prepare(req)
        for i in range(0, len(page), 8192):  # as over a network: 8 KiB pieces, a little apart
            await resp.write(page[i:i + 8192])
            await asyncio.sleep(0.0005)
        await resp.write_eof()
        return resp

    async with polled(start_app, {"/metrics": metrics}) as ([url], router):
        el = EngineLoads(2.0)
        await el.poll(router)
        assert el.tokens(url, None) == 8 * 4000 and el.waiting_reqs[url] == {e: 1 for e in range(8)}


async def test_a_slow_worker_does_not_hold_back_the_others_polls_nor_is_asked_twice(start_app):
    """In the background loop (wait=False) each round asks the workers whose last poll has come back;
    one whose /metrics takes long is not asked again while out, and the others keep fresh figures."""
    import asyncio

    asked = {"fast": 0, "slow": 0}
    release = asyncio.Event()

    def counted(name, handler):
        async def metrics(req):
            asked[name] += 1
            return await handler(req)
        return metrics

    fast_routes = {"/metrics": counted("fast", serve(VLLM_METRICS)), "/v1/loads": not_found}
    slow_routes = {"/metrics": counted("slow", serve(VLLM_METRICS, release)), "/v1/loads": not_found}
    async with polled(start_app, fast_routes, slow_routes) as ([fast, slow], router):
        try:
            el = EngineLoads(5.0)
            for _ in range(3):
                await el.poll(router, wait=False)
                await until(lambda: fast not in el._asking)  # the fast worker's answer is in
            assert asked == {"fast": 3, "slow": 1} and el.tokens(fast, None) == 12000
            assert slow in el._asking and el.tokens(slow, None) is None
            release.set()
            await until(lambda: not el._tasks)
            assert el.tokens(slow, None) == 12000 and not el._asking
        finally:
            release.set()


async def test_a_worker_removed_while_its_poll_is_out_keeps_no_figure(start_app):
    import asyncio

    urls = []
    gate = asyncio.Event()
    async with polled(start_app, {"/metrics": serve(VLLM_METRICS, gate)}, urls=urls) as ([url], router):
        try:
            el = EngineLoads(5.0)
            await el.poll(router, wait=False)
            await asyncio.sleep(0.05)
            urls.clear()  # removed from the router while the answer is on its way
            gate.set()
            await until(lambda: not el._tasks)
            assert url not in el.snapshots and url not in el.pools and url not in el.running_only
        finally:
            gate.set()


def test_removing_a_worker_drops_its_engine_figures_at_once():
    pol = kv()
    el = pol.engine_loads = EngineLoads(1.0)
    el.put(A, {0: 5000}, running_only=True)
    el.pools[A] = {0: 16000}
    pol.on_worker_removed(A)
    assert A not in el.snapshots and A not in el.pools and A not in el.running_only


def test_the_engine_load_gauge_of_a_one_rank_worker_takes_off_ended_requests_without_dp_aware():
    """A trial saw 860 on /metrics where the cost used 60: without --dp-aware an ended request is kept
    for the whole worker (rank None), and the gauge asked for rank 0 only."""
    import os
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from test_kv_aware_queue_metric import scrape

    pol = kv()
    for url in (A, B):
        pol.subs[url] = {0: SimpleNamespace(state="exact", events=0, batches=0, malformed=0, gaps=0, replays=0,
                                            replay_failures=0)}
    el = pol.engine_loads = EngineLoads(5.0)
    key = RouteKey("", list(range(5000, 5800)), 60)
    assert pol.select([Worker(A), Worker(B)], key).url == A
    pol.prefilled(key)
    el.put(A, {0: 860}, time.monotonic(), running_only=True)
    assert scrape(pol, "fleetserve_router_kv_engine_load_tokens") == {(A, "0"): 860.0}
    pol.release(key)
    assert scrape(pol, "fleetserve_router_kv_engine_load_tokens") == {(A, "0"): 60.0}


def test_a_vllm_servers_dp_ranks_come_from_its_engine_labels_for_dp_aware():
    """vLLM reports no dp_size: a trial saw every --dp-aware request pinned to rank 0 of a 2-engine vLLM
    server whose rank 0 was 90% full.  The engine labels of its /metrics now give the ranks."""
    pol = KvAwarePolicy(speculative_ttl_s=0, dp_aware=True)
    el = pol.engine_loads = EngineLoads(5.0)
    assert pol.ranks(A) == (0,) and not pol.ranks_known(A)
    el.put(A, {0: 14400, 1: 0}, running_only=True)
    el.engine_ranks[A] = (0, 1)  # as _ask sets it from the page
    assert pol.ranks(A) == (0, 1) and pol.ranks_known(A)
    key = RouteKey("", list(range(3000, 3100)), 16)
    assert pol.select([Worker(A)], key).url == A and key.rank == 1
    assert b"X-data-parallel-rank: 1" in pol.decorate(key, b'{"prompt": "x"}', b"")[1]
    pol.dp_ranks[A] = (0, 1, 2)  # /get_server_info's dp_size, when a worker gives one, wins
    assert pol.ranks(A) == (0, 1, 2)


async def test_the_page_sets_engine_ranks_only_for_ranks_0_to_n(start_app):
    """Ranks 0..n-1 are taken; a later page naming ranks 1 and 4 drops them (a trial saw the old ranks
    kept); more ranks than a dp_size may name (MAX_DP_SIZE) are not taken (a trial saw 1000 engine labels
    open 1000 sockets, after which no other worker could be subscribed)."""
    from fleetserve.router.kv_events.sources import MAX_DP_SIZE

    many = "".join('vllm:kv_cache_usage_perc{engine="%d"} 0.0\n' % e + info(str(e)) + "\n"
                   for e in range(MAX_DP_SIZE + 1))
    pages = iter([VLLM_METRICS, VLLM_METRICS.replace('engine="0"', 'engine="4"'), VLLM_METRICS, many])

    async def metrics(_req):
        return web.Response(text=next(pages), content_type="text/plain")

    async with polled(start_app, {"/metrics": metrics}) as ([url], router):
        el = EngineLoads(5.0)
        await el.poll(router)
        assert el.engine_ranks[url] == (0, 1)
        await el.poll(router)  # ranks 1 and 4: not taken as the server's DP ranks, and the old ones go
        assert url not in el.engine_ranks and el.tokens(url, None) == 12000
        await el.poll(router)
        assert el.engine_ranks[url] == (0, 1)
        await el.poll(router)  # 257 engines: figures, but no ranks
        assert url not in el.engine_ranks and len(el.snapshots[url][1]) == MAX_DP_SIZE + 1


async def test_a_kv_events_endpoint_worker_is_subscribed_per_rank_once_its_metrics_name_the_ranks(start_app):
    """--kv-events-endpoint for a vLLM server (no /get_server_info): rank 0 alone at first; once its
    /metrics names engines 0 and 1, ranks 0 and 1 at the endpoint's port and port + 1 (vLLM's offset)."""
    from fleetserve.router.kv_events.sources import KvEventSources

    pol = KvAwarePolicy(speculative_ttl_s=0, dp_aware=True)
    el = pol.engine_loads = EngineLoads(5.0)
    async with polled(start_app, {}) as ([url], router):  # 404 on /get_server_info, as vLLM
        sources = KvEventSources(pol, {url: "tcp://127.0.0.1:45600"})
        try:
            await sources.sync(router)
            assert sorted(pol.subs[url]) == [0]
            el.engine_ranks[url] = (0, 1)
            await sources.sync(router)
            subs = pol.subs[url]
            assert sorted(subs) == [0, 1]
            assert [subs[r].endpoint for r in (0, 1)] == ["tcp://127.0.0.1:45600", "tcp://127.0.0.1:45601"]
            await sources.sync(router)  # nothing more to learn: the same subscriptions
            assert pol.subs[url] is subs
            el.engine_ranks[url] = (0, 1, 2, 3)
            await sources.sync(router)
            assert sorted(pol.subs[url]) == [0, 1, 2, 3]
            el.engine_ranks[url] = (0, 1)  # fewer engines now: ranks 2 and 3 are not kept
            await sources.sync(router)
            assert sorted(pol.subs[url]) == [0, 1] and pol.ranks(url) == [0, 1]
        finally:
            sources.close()


async def test_stopping_the_poll_loop_cancels_the_polls_still_out(start_app):
    import asyncio

    gate = asyncio.Event()
    async with polled(start_app, {"/metrics": serve(VLLM_METRICS, gate)}) as ([url], router):
        try:
            el = EngineLoads(5.0)
            loop_task = asyncio.ensure_future(el.run(router))
            await until(lambda: url in el._asking)
            assert url in el._asking
            loop_task.cancel()
            await asyncio.gather(loop_task, return_exceptions=True)
            await asyncio.sleep(0.01)
            assert not el._tasks and not el._asking
        finally:
            gate.set()
