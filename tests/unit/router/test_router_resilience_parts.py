"""Circuit breaker states, retry backoff and config parsing."""

import random

import pytest

from fleetserve.router.circuit_breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from fleetserve.router.config import parse_args
from fleetserve.router.retry import backoff_delay_s


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_breaker_opens_waits_half_opens_and_closes():
    clk = Clock()
    cb = CircuitBreaker(failure_threshold=3, success_threshold=2, timeout_s=10, window_s=60, clock=clk)
    cb.record_failure(); cb.record_failure()
    assert cb.state == CLOSED and cb.allows()
    cb.record_failure()
    assert cb.state == OPEN and not cb.allows()
    clk.t += 10.5
    assert cb.allows() and cb.state == HALF_OPEN
    cb.record_failure()
    assert cb.state == OPEN and not cb.allows()
    clk.t += 11
    assert cb.allows()
    cb.record_success()
    assert cb.state == HALF_OPEN
    cb.record_success()
    assert cb.state == CLOSED


def test_breaker_success_and_window_reset_failures():
    clk = Clock()
    cb = CircuitBreaker(failure_threshold=2, window_s=5, clock=clk)
    cb.record_failure(); cb.record_success(); cb.record_failure()
    assert cb.state == CLOSED
    clk.t += 6
    cb.record_failure()
    assert cb.state == CLOSED  # the earlier failure fell out of the window
    cb.record_failure()
    assert cb.state == OPEN
    off = CircuitBreaker(failure_threshold=1, enabled=False)
    off.record_failure()
    assert off.allows() and off.state == CLOSED


def test_backoff_grows_caps_and_jitters():
    assert backoff_delay_s(1, 50, 1000, 2.0, 0.0) == pytest.approx(0.05)
    assert backoff_delay_s(3, 50, 1000, 2.0, 0.0) == pytest.approx(0.2)
    assert backoff_delay_s(10, 50, 1000, 2.0, 0.0) == pytest.approx(1.0)
    rng = random.Random(1)
    ds = [backoff_delay_s(2, 100, 10000, 1.5, 0.2, rng) for _ in range(200)]
    assert all(0.12 <= d <= 0.18 for d in ds) and max(ds) - min(ds) > 0.03
    with pytest.raises(ValueError):
        backoff_delay_s(0)


def test_cli_flags_follow_sglang_router():
    cfg = parse_args(["--worker-urls", "http://a:1", "http://b:2", "--policy", "round_robin",
                      "--cache-threshold", "0.4", "--balance-abs-threshold", "8", "--balance-rel-threshold", "2",
                      "--eviction-interval-secs", "5", "--max-tree-size", "1000", "--max-payload-size", "99",
                      "--retry-max-retries", "3", "--disable-retries", "--cb-failure-threshold", "4",
                      "--health-check-interval-secs", "2", "--health-failure-threshold", "5", "--port", "1234"])
    assert cfg.worker_urls == ["http://a:1", "http://b:2"] and cfg.policy == "round_robin"
    assert (cfg.cache_threshold, cfg.balance_abs_threshold, cfg.balance_rel_threshold) == (0.4, 8, 2.0)
    assert (cfg.max_tree_size, cfg.max_payload_size, cfg.port) == (1000, 99, 1234)
    assert cfg.max_attempts == 1 and cfg.cb_failure_threshold == 4 and cfg.health_failure_threshold == 5
    d = parse_args([])
    assert (d.cache_threshold, d.balance_abs_threshold, d.balance_rel_threshold) == (0.3, 64, 1.5)
    assert (d.eviction_interval_secs, d.max_tree_size, d.policy, d.max_attempts) == (60, 2**26, "cache_aware", 5)
    with pytest.raises(SystemExit):
        parse_args(["--cache-threshold", "1.5"])
    with pytest.raises(SystemExit):
        parse_args(["--worker-urls", "https://a:1"])


@pytest.mark.parametrize("argv", [
    ["--worker-urls", "http://127.0.0.1:99999"], ["--worker-urls", "http://127.0.0.1:notaport"],
    ["--worker-urls", "http://:80"], ["--worker-urls", "127.0.0.1:0"], ["--port", "70000"], ["--port", "-5"],
    ["--health-check-interval-secs", "0"], ["--request-timeout-secs", "-1"], ["--health-check-timeout-secs", "0"],
    ["--worker-startup-timeout-secs", "0"], ["--worker-startup-check-interval", "-1"]])
def test_cli_refuses_bad_urls_ports_and_intervals(argv, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert "error:" in capsys.readouterr().err


def test_worker_urls_are_normalized_or_refused_with_the_reason():
    from fleetserve.router.workers import normalize_url

    assert normalize_url(" 127.0.0.1:8000/ ") == "http://127.0.0.1:8000"
    assert normalize_url("http://host") == "http://host"
    # one worker, one name: scheme and host case do not make a second worker
    assert normalize_url("HTTP://LocalHost:8000") == "http://localhost:8000"
    assert normalize_url("http://[::1]:8000/") == "http://[::1]:8000"
    for bad, why in (("", "empty"), ("http://h:65536", "1..65535"), ("http://h:x", "1..65535"),
                     ("https://h:1", "http://"), ("http://", "no host"), ("http://h:1?x=1", "no path"),
                     ("http://h:1/v1", "no path"), ("http://h:1#f", "no path"), ("http://u@h:1", "no path")):
        with pytest.raises(ValueError, match=why):
            normalize_url(bad)


def test_start_up_wait_says_every_interval_which_workers_it_still_waits_for(monkeypatch, caplog):
    """A --worker-urls worker that never answers: a line every STARTUP_LOG_INTERVAL_S naming it,
    then the timeout line and exit 1 (the user does not stare at one line for 30 minutes)."""
    import asyncio
    import logging
    import socket

    from fleetserve.router import cli

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setattr(cli, "STARTUP_LOG_INTERVAL_S", 0.3)
    cfg = parse_args(["--port", "0", "--worker-urls", dead, "--worker-startup-timeout-secs", "1.2",
                      "--worker-startup-check-interval", "0.1"])
    with caplog.at_level(logging.INFO, logger="fleetserve.router"):
        assert asyncio.run(cli.serve(cfg)) == 1
    lines = [r.getMessage() for r in caplog.records]
    waiting = [x for x in lines if x.startswith("still waiting for ")]
    assert len(waiting) >= 2 and all(x.startswith(f"still waiting for {dead} to become healthy (") for x in waiting)
    assert waiting[0].endswith(" of 1.2 s)")
    assert lines[-1] == f"workers not healthy within 1.2 s: {dead}"
