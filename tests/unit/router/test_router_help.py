"""``fleetserve router --help``: every flag has a one-line help with its default."""

import argparse
import re

from fleetserve.router.config import build_parser


def test_every_router_flag_has_help():
    parser = build_parser()
    missing = [a.option_strings[0] for a in parser._actions
               if a.option_strings and a.help != argparse.SUPPRESS and not (a.help or "").strip()]
    assert missing == []


def test_help_shows_the_health_and_retry_flags_with_their_defaults(monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # one line per flag
    text = build_parser().format_help()
    lines = {m.group(1): m.group(2) for m in re.finditer(r"^  (--[\w-]+)(?: \S+)?\s+(.*)$", text, re.M)}
    assert lines["--health-check-interval-secs"] == ("seconds between two rounds of periodic health checks "
                                                     "(as sglang-router's, same default) (default: 60.0)")
    assert lines["--health-check-timeout-secs"] == ("a health check not answered 2xx within this many seconds "
                                                    "fails (as sglang-router's, same default) (default: 5.0)")
    assert lines["--health-check-endpoint"].endswith("(default: /health)")
    for flag, default in (("--retry-initial-backoff-ms", "50.0"), ("--retry-max-backoff-ms", "30000.0"),
                          ("--retry-backoff-multiplier", "1.5"), ("--retry-jitter-factor", "0.2"),
                          ("--disable-retries", "False"), ("--disable-circuit-breaker", "False"),
                          ("--log-level", "info"), ("--policy", "cache_aware")):
        assert lines[flag].endswith(f"(default: {default})"), flag
