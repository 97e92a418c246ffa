"""Timing model arithmetic and flags, /metrics parsing, report percentiles."""

import pytest

from fleetserve.bench import timing_model
from fleetserve.bench.client import RequestResult
from fleetserve.bench.report import summarize
from fleetserve.bench.worker_stats import delta, parse_counters


def test_timing_model_formulas_and_overrides():
    import argparse

    p = argparse.ArgumentParser()
    timing_model.add_arguments(p)
    m = timing_model.from_args(p.parse_args(["--profile", "cpu-smollm2", "--decode-base-s", "0.05",
                                             "--time-scale", "2"]))
    assert m.decode_base_s == 0.05 and m.decode_per_req_s == 2.8e-3 and m.max_total_tokens == 65_536
    assert m.decode_time(10, 1000) == pytest.approx((0.05 + 10 * 2.8e-3) * 2)
    assert m.prefill_time(100) == pytest.approx((2e-3 + 100 * 5.5e-4) * 2)
    d = timing_model.from_args(p.parse_args([]))
    assert d.decode_time(4, 10_000) == pytest.approx(6.8e-3 + 4 * 8e-5 + 10_000 * 56e-9)
    with pytest.raises(ValueError):
        timing_model.from_args(p.parse_args(["--max-total-tokens", "0"]))


def test_sim_worker_page_size_flag():
    from fleetserve.bench import sim_worker

    p = sim_worker.build_parser()
    assert timing_model.from_args(p.parse_args([])).page_size == 1
    assert timing_model.from_args(p.parse_args(["--page-size", "16"])).page_size == 16
    for argv, msg in [(["--page-size", "0"], "--page-size must be >= 1, got 0"),
                      (["--page-size", "3"], "--page-size (3) must divide --chunked-prefill-size (8192)"),
                      (["--page-size", "64", "--max-total-tokens", "32"],
                       "--page-size (64) is larger than the KV pool (--max-total-tokens 32)")]:
        with pytest.raises(ValueError) as e:
            timing_model.from_args(p.parse_args(argv))
        assert str(e.value) == msg


def test_parse_counters_and_delta():
    text = """# TYPE fleetserve:prompt_tokens_total counter
fleetserve:prompt_tokens_total{rank="0"} 100.0
fleetserve:prompt_tokens_total{rank="1"} 50.0
sglang:cached_tokens_total 30
fleetserve:num_requests_total 4
fleetserve:num_running_reqs 7
"""
    c = parse_counters(text)
    assert c == {"num_requests": 4.0, "prompt_tokens": 150.0, "cached_tokens": 30.0, "generation_tokens": 0.0}
    d = delta({"a": c, "b": None}, {"a": {**c, "prompt_tokens": 400.0}, "b": c})
    assert d == {"a": {"num_requests": 0.0, "prompt_tokens": 250.0, "cached_tokens": 0.0, "generation_tokens": 0.0}}


def test_summary_percentiles_and_failures():
    rs = []
    for i in range(100):
        rs.append(RequestResult(rid=str(i), group="g", success=True, prompt_tokens=10, cached_tokens=i % 2 * 10,
                                completion_tokens=5, ttft=(i + 1) / 100, itl=[0.01, 0.03], latency=(i + 1) / 100 + 0.04,
                                worker="w" + str(i % 2)))
    rs.append(RequestResult(rid="x", group="g", success=False, error="boom"))
    s = summarize(rs, duration_s=10.0)
    assert s["completed"] == 100 and s["failed"] == 1 and s["errors"] == ["boom"]
    assert s["ttft_s"]["p50"] == pytest.approx(0.505) and s["ttft_s"]["p99"] == pytest.approx(0.9901)
    assert s["ttft_s"]["mean"] == pytest.approx(0.505)
    assert s["itl_s"]["mean"] == pytest.approx(0.02) and s["tpot_s"]["mean"] == pytest.approx(0.01)
    assert s["request_throughput"] == pytest.approx(10.0) and s["output_throughput"] == pytest.approx(50.0)
    assert s["cache_hit_rate"] == pytest.approx(0.5)
    assert s["per_worker"]["w1"]["hit_rate"] == 1.0 and s["per_worker"]["w0"]["hit_rate"] == 0.0


@pytest.mark.parametrize("flags", [["--request-rate", "-1"], ["--request-rate", "0"], ["--request-rate", "nan"],
                                   ["--num-prompts", "0"], ["--max-concurrency", "0"]])
def test_bench_rejects_impossible_load_settings(flags, capsys):
    from fleetserve.bench.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--base-url", "http://127.0.0.1:9", "--workload", "random", *flags])
    assert e.value.code == 2
    assert flags[0] in capsys.readouterr().err


def test_non_streamed_requests_report_itl_and_tpot_as_not_measured(capsys):
    """``--no-stream``: no token timings, so ITL and TPOT are n/a (they read 0.0 before)."""
    from fleetserve.bench.report import print_table

    rs = [RequestResult(rid=str(i), group="g", success=True, prompt_tokens=10, completion_tokens=8,
                        ttft=0.5, latency=0.5) for i in range(4)]
    s = summarize(rs, duration_s=1.0)
    assert s["itl_s"] == {"mean": None, "p50": None, "p99": None}
    assert s["tpot_s"] == {"mean": None, "p50": None, "p99": None}
    assert s["ttft_s"]["mean"] == pytest.approx(0.5)
    print_table(s)
    out = capsys.readouterr().out
    assert "ITL mean / p50 / p99 (ms)" in out and out.count("n/a") == 2


def test_sim_worker_dp_size_is_bounded():
    """--dp-size 100000 was taken without a word and the worker never listened (an engine per rank)."""
    from fleetserve.bench import sim_worker
    from fleetserve.bench.sim_args import MAX_DP_SIZE, check_args

    p = sim_worker.build_parser()
    assert check_args(p.parse_args(["--dp-size", str(MAX_DP_SIZE)])) is None
    assert check_args(p.parse_args(["--dp-size", "100000"])) == (
        f"--dp-size must be at most {MAX_DP_SIZE} (a simulated engine per rank), got 100000")
    assert check_args(p.parse_args(["--dp-size", "0"])) == "--dp-size must be >= 1, got 0"
