from prometheus_client.parser import text_string_to_metric_families

from fleetserve.engine.io_struct import SchedulerStats
from fleetserve.entrypoints.metrics import EngineMetrics


def samples(m: EngineMetrics) -> dict[str, float]:
    out = {}
    for fam in text_string_to_metric_families(m.render().decode()):
        for s in fam.samples:
            key = s.name + ("" if "le" not in s.labels else f"[le={s.labels['le']}]")
            out[key] = s.value
    return out


def test_gauges_sum_over_dp_ranks_and_rates():
    m = EngineMetrics("tiny")
    tot = m.set_stats([
        SchedulerStats(num_running_reqs=2, num_waiting_reqs=1, kv_pool_size=100, kv_used_tokens=30,
                       prompt_tokens_total=40, cached_prompt_tokens_total=10),
        SchedulerStats(num_running_reqs=1, kv_pool_size=100, kv_used_tokens=10, dp_rank=1,
                       prompt_tokens_total=60, cached_prompt_tokens_total=40),
    ])
    assert tot["num_running_reqs"] == 3
    s = samples(m)
    assert s["fleetserve:num_running_reqs"] == 3
    assert s["fleetserve:num_waiting_reqs"] == 1
    assert s["fleetserve:kv_used_tokens"] == 40
    assert abs(s["fleetserve:token_usage"] - 0.2) < 1e-12
    assert abs(s["fleetserve:cache_hit_rate"] - 0.5) < 1e-12


def test_counters_and_histograms():
    m = EngineMetrics("tiny")
    m.observe_first_token(0.3)
    m.observe_tokens(4, 0.02)  # 4 tokens at 5 ms each
    m.observe_finished(prompt_tokens=12, completion_tokens=5, cached_tokens=8, e2e_seconds=0.4)
    s = samples(m)
    assert s["fleetserve:prompt_tokens_total"] == 12
    assert s["fleetserve:generation_tokens_total"] == 5
    assert s["fleetserve:cached_tokens_total"] == 8
    assert s["fleetserve:time_to_first_token_seconds_count"] == 1
    assert s["fleetserve:time_to_first_token_seconds_bucket[le=0.25]"] == 0
    assert s["fleetserve:time_to_first_token_seconds_bucket[le=0.5]"] == 1
    assert s["fleetserve:inter_token_latency_seconds_count"] == 4
    assert s["fleetserve:inter_token_latency_seconds_bucket[le=0.005]"] == 4
    assert s["fleetserve:inter_token_latency_seconds_bucket[le=0.0025]"] == 0


def test_kv_event_counters_follow_the_schedulers_totals():
    from fleetserve.engine.io_struct import SchedulerStats
    from fleetserve.entrypoints.metrics import EngineMetrics

    m = EngineMetrics("m")
    m.set_stats([SchedulerStats(dp_rank=0), SchedulerStats(dp_rank=1)])
    text = m.render().decode()
    assert 'fleetserve:kv_events_published_total{model_name="m"} 0.0' in text
    assert 'fleetserve:kv_events_dropped_total{model_name="m"} 0.0' in text
    m.set_stats([SchedulerStats(kv_events_published=5, kv_events_dropped=1),
                 SchedulerStats(kv_events_published=7, dp_rank=1)])
    m.set_stats([SchedulerStats(kv_events_published=5, kv_events_dropped=1)])  # rank 1 late: no decrease
    m.set_stats([SchedulerStats(kv_events_published=6, kv_events_dropped=1),
                 SchedulerStats(kv_events_published=7, dp_rank=1)])
    text = m.render().decode()
    assert 'fleetserve:kv_events_published_total{model_name="m"} 13.0' in text
    assert 'fleetserve:kv_events_dropped_total{model_name="m"} 1.0' in text
