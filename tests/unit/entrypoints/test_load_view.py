"""SGLang's /v1/loads and /get_load bodies, the routed-DP-rank checks, and the SGLang / vLLM metric names."""

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleetserve.engine.io_struct import SchedulerStats
from fleetserve.entrypoints.errors import APIError
from fleetserve.entrypoints.load_view import (
    LoadsQueryError, legacy_load, loads_body, loads_prometheus, parse_include, parse_loads_query, rank_load,
    select_ranks,
)
from fleetserve.entrypoints.metrics import EngineMetrics
from fleetserve.entrypoints.validation import resolve_routed_dp_rank

R0 = SchedulerStats(num_running_reqs=2, num_waiting_reqs=3, kv_pool_size=1000, kv_used_tokens=250,
                    prompt_tokens_total=400, cached_prompt_tokens_total=100, generation_tokens_total=77,
                    num_waiting_uncached_tokens=120, num_pending_tokens=150, max_running_requests=8,
                    gen_throughput=12.345, prefill_throughput=56.781, timestamp=1710000000.25, dp_rank=0)
R1 = SchedulerStats(kv_pool_size=1000, max_running_requests=8, dp_rank=1)

# SGLang's GetLoadsReqOutput core fields (plus its older num_total_reqs): python/sglang/srt/managers/io_struct.py,
# dp_rank, timestamp (time.time() in the scheduler), ..., gen_throughput, prefill_throughput, cache_hit_rate, ...
CORE_FIELDS = {"dp_rank", "timestamp", "prefill_throughput", "num_running_reqs", "num_waiting_reqs", "num_total_reqs", "num_waiting_uncached_tokens",
               "num_used_tokens", "num_total_tokens", "max_total_num_tokens", "max_running_requests", "token_usage",
               "gen_throughput", "cache_hit_rate", "utilization"}


def test_rank_load_has_sglangs_fields_and_values():
    d = rank_load(R0)
    assert set(d) == CORE_FIELDS
    assert d == {"dp_rank": 0, "timestamp": 1710000000.25, "prefill_throughput": 56.78, "num_running_reqs": 2, "num_waiting_reqs": 3, "num_total_reqs": 5,
                 "num_waiting_uncached_tokens": 120, "num_used_tokens": 250, "num_total_tokens": 400,
                 "max_total_num_tokens": 1000, "max_running_requests": 8, "token_usage": 0.25,
                 "gen_throughput": 12.35, "cache_hit_rate": 0.25, "utilization": 0.0}


def test_loads_body_top_level_and_aggregate():
    body = loads_body([R0, R1], num_accelerators=1)
    assert set(body) == {"timestamp", "version", "dp_rank_count", "accelerator", "num_accelerators", "loads",
                         "aggregate"}
    assert body["dp_rank_count"] == 2 and [d["dp_rank"] for d in body["loads"]] == [0, 1]
    assert body["timestamp"].endswith("+00:00")
    assert body["aggregate"] == {"total_running_reqs": 2, "total_waiting_reqs": 3, "total_reqs": 5,
                                 "avg_token_usage": 0.125, "avg_throughput": 6.17, "avg_utilization": 0.0,
                                 "total_waiting_uncached_tokens": 120, "total_used_tokens": 250, "total_tokens": 400}
    empty = loads_body([], 1)["aggregate"]
    assert empty["total_reqs"] == 0 and empty["avg_token_usage"] == 0.0


def test_legacy_get_load_shape():
    assert legacy_load([R1, R0], ts_tic=5.0) == [
        {"dp_rank": 0, "num_reqs": 5, "num_waiting_reqs": 3, "num_tokens": 400, "num_pending_tokens": 150,
         "ts_tic": 5.0},
        {"dp_rank": 1, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0, "num_pending_tokens": 0, "ts_tic": 5.0},
    ]


def test_prometheus_format_is_sglang_underscore_names_per_dp_rank():
    fams = {f.name: f for f in text_string_to_metric_families(loads_prometheus([R0, R1]).decode())}
    assert fams["sglang_num_running_reqs"].type == "gauge"
    got = {s.labels["dp_rank"]: s.value for s in fams["sglang_num_waiting_uncached_tokens"].samples}
    assert got == {"0": 120.0, "1": 0.0}
    assert {s.value for s in fams["sglang_token_usage"].samples} == {0.25, 0.0}
    got = {s.labels["dp_rank"]: s.value for s in fams["sglang_prefill_throughput"].samples}
    assert got == {"0": 56.78, "1": 0.0}  # SGLang's name (its test_v1_loads checks sglang_prefill_throughput)
    assert "sglang_timestamp" not in fams  # a time, not a gauge SGLang exports


def test_include_and_dp_rank_selection():
    assert parse_include(None) == {"all"} and parse_include("core, queues") == {"core", "queues"}
    with pytest.raises(ValueError, match=r"Invalid include sections: \['bogus'\]"):
        parse_include("core,bogus")
    assert select_ranks([R1, R0], 2, None) == [R0, R1]
    assert select_ranks([R1, R0], 2, 1) == [R1]
    with pytest.raises(ValueError, match=r"dp_rank=2 out of range \[0, 2\)"):
        select_ranks([R0, R1], 2, 2)


def test_loads_query_parameters():
    assert parse_loads_query({}) == ("json", None)
    assert parse_loads_query({"format": "prometheus", "dp_rank": "1", "include": "core"}) == ("prometheus", 1)
    for q, param in (({"include": "core,bogus"}, "include"), ({"format": "xml"}, "format"),
                     ({"dp_rank": "one"}, "dp_rank")):
        with pytest.raises(LoadsQueryError) as e:
            parse_loads_query(q)
        assert e.value.param == param and param in str(e.value)


@pytest.mark.parametrize("body, header, dp_size, want", [
    (None, None, 2, None), (1, None, 2, 1), (0, None, 2, 0), (None, "1", 2, 1), (0, " 1 ", 2, 1),
    (0, None, 1, None),                     # SGLang: rank 0 with dp_size 1 is ignored
    (None, "0", 1, None),
])
def test_routed_dp_rank_accepted(body, header, dp_size, want):
    assert resolve_routed_dp_rank(body, header, dp_size) == want


@pytest.mark.parametrize("body, header, dp_size, message, param", [
    (2, None, 2, "routed_dp_rank=2 out of range [0, 2)", "routed_dp_rank"),
    (-1, None, 2, "routed_dp_rank=-1 out of range [0, 2)", "routed_dp_rank"),
    (1, None, 1, "routed_dp_rank=1 out of range [0, 1)", "routed_dp_rank"),
    (None, "3", 2, "routed_dp_rank=3 out of range [0, 2)", None),
    (None, "one", 2, "Invalid X-Data-Parallel-Rank header: must be an integer, got 'one'", None),
    ("1", None, 2, "routed_dp_rank must be an integer in [0, 2), got '1'", "routed_dp_rank"),
    (True, None, 2, "routed_dp_rank must be an integer in [0, 2), got True", "routed_dp_rank"),
    (1.0, None, 2, "routed_dp_rank must be an integer in [0, 2), got 1.0", "routed_dp_rank"),
])
def test_routed_dp_rank_refused(body, header, dp_size, message, param):
    with pytest.raises(APIError) as e:
        resolve_routed_dp_rank(body, header, dp_size)
    assert e.value.status == 400 and str(e.value.message) == message and e.value.param == param


def test_metrics_carry_sglang_and_vllm_names_per_dp_rank():
    m = EngineMetrics("tiny")
    m.set_stats([R0, R1])
    series = {}
    for fam in text_string_to_metric_families(m.render().decode()):
        for s in fam.samples:
            series[(s.name, tuple(sorted(s.labels.items())))] = s.value

    def sg(name, rank):
        return series[(name, (("dp_rank", str(rank)), ("engine_type", "unified"), ("model_name", "tiny"),
                              ("tp_rank", "0")))]

    def vl(name, rank):
        return series[(name, (("engine", str(rank)), ("model_name", "tiny")))]

    assert sg("sglang:num_running_reqs", 0) == 2 and sg("sglang:num_queue_reqs", 0) == 3
    assert sg("sglang:num_used_tokens", 0) == 250 and sg("sglang:token_usage", 0) == 0.25
    assert sg("sglang:cache_hit_rate", 0) == 0.25 and sg("sglang:gen_throughput", 0) == 12.345
    assert sg("sglang:prompt_tokens_total", 0) == 400 and sg("sglang:cached_tokens_total", 0) == 100
    assert sg("sglang:num_running_reqs", 1) == 0
    assert vl("vllm:num_requests_running", 0) == 2 and vl("vllm:num_requests_waiting", 0) == 3
    assert vl("vllm:kv_cache_usage_perc", 0) == 0.25
    assert vl("vllm:prefix_cache_queries_total", 0) == 400 and vl("vllm:prefix_cache_hits_total", 0) == 100
    assert vl("vllm:generation_tokens_total", 0) == 77 and vl("vllm:num_requests_waiting", 1) == 0
