"""kv_aware's engine loads from a vLLM worker: no ``/v1/loads``, so the router reads vLLM's scheduler
gauges on ``GET /metrics`` (loads.vllm_figures) and counts them as the running requests' KV alone."""

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
    import aiohttp

    hits = {"loads": 0, "metrics": 0}
    page = {"text": VLLM_METRICS}

    async def loads(_req):
        hits["loads"] += 1
        return web.json_response({"detail": "Not Found"}, status=404)

    async def metrics(_req):
        hits["metrics"] += 1
        return web.Response(text=page["text"], content_type="text/plain")

    app = web.Application()
    app.router.add_get("/v1/loads", loads)
    app.router.add_get("/metrics", metrics)
    runner, url = await start_app(app)
    try:
        async with aiohttp.ClientSession() as session:
            router = SimpleNamespace(session=session, own_headers=lambda url: {},
                                     registry=SimpleNamespace(urls=lambda: [url]))
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
    finally:
        await runner.cleanup()


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
    import aiohttp

    from fleetserve.router.kv_events import loads

    monkeypatch.setattr(loads, "METRICS_MAX_BYTES", len(VLLM_METRICS) - 1)

    async def metrics(_req):
        return web.Response(text=VLLM_METRICS, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner, url = await start_app(app)
    try:
        async with aiohttp.ClientSession() as session:
            router = SimpleNamespace(session=session, own_headers=lambda url: {},
                                     registry=SimpleNamespace(urls=lambda: [url]))
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
    finally:
        await runner.cleanup()
