"""Flags read by one policy only, given under another: accepted (as sglang-router / smg do) with one
warning line each at start-up (router/policy_flags.py)."""

import logging

import pytest

from fleetserve.router import cli
from fleetserve.router.config import parse_args
from fleetserve.router.policy_flags import READ_BY, policy_flag_warnings


def _warnings(argv):
    return policy_flag_warnings(argv, parse_args(argv))


@pytest.mark.parametrize("argv,lines", [
    (["--policy", "round_robin", "--kv-prefill-weight", "2", "--kv-load-weight=0.3", "--dp-aware",
      "--kv-events-endpoint", "http://127.0.0.1:1=tcp://127.0.0.1:5557"],
     ["--kv-events-endpoint has no effect under --policy round_robin (read only under kv_aware)",
      "--kv-prefill-weight has no effect under --policy round_robin (read only under kv_aware)",
      "--kv-load-weight has no effect under --policy round_robin (read only under kv_aware)",
      "--dp-aware has no effect under --policy round_robin (read only under kv_aware)"]),
    (["--policy", "kv_aware", "--cache-threshold", "0.5", "--max-tree-size", "100", "--bounded-load-factor", "2"],
     ["--cache-threshold has no effect under --policy kv_aware (read only under cache_aware)",
      "--bounded-load-factor has no effect under --policy kv_aware (read only under cache_aware)"]),
    (["--policy", "random", "--balance-abs-threshold", "8", "--eviction-interval-secs", "5"],
     ["--balance-abs-threshold has no effect under --policy random (read only under cache_aware, or with "
      "--sticky-sessions)",
      "--eviction-interval-secs has no effect under --policy random (read only under cache_aware or kv_aware)"]),
    (["--policy", "random", "--sticky-sessions", "--balance-abs-threshold", "8"], []),  # sessions read it
    (["--policy", "kv_aware", "--kv-prefill-weight", "2", "--kv-overflow-weight", "1"], []),
    (["--cache-threshold", "0.5", "--balance-rel-threshold", "2"], []),  # cache_aware is the default
    (["--policy", "round_robin", "--kv-prefill-w", "2"],  # argparse's abbreviation is the flag too
     ["--kv-prefill-weight has no effect under --policy round_robin (read only under kv_aware)"]),
    (["--policy", "round_robin"], []),  # defaults are no one's choice
])
def test_one_warning_line_per_flag_the_policy_does_not_read(argv, lines):
    assert _warnings(argv) == lines


def test_every_kv_aware_flag_is_known_as_kv_aware_only():
    from fleetserve.router.config import build_parser

    group = next(g for g in build_parser()._action_groups if g.title.startswith("kv_aware"))
    dests = {a.dest for a in group._group_actions} - {"no_route_header"}  # every policy: the route header
    assert dests and all(READ_BY[d] == ("kv_aware",) for d in dests)


def test_the_router_logs_them_at_start_up(monkeypatch, caplog):
    monkeypatch.setattr(cli.asyncio, "run", lambda coro: coro.close() or 0)
    import uvloop
    monkeypatch.setattr(uvloop, "run", lambda coro: coro.close() or 0)
    with caplog.at_level(logging.WARNING, logger="fleetserve.router"):
        assert cli.main(["--policy", "power_of_two", "--kv-speculative-ttl-secs", "1"]) == 0
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        "--kv-speculative-ttl-secs has no effect under --policy power_of_two (read only under kv_aware)"]
