"""``python -m fleetserve.router.args_check``: the router's flag checks without starting a router."""

import json
import subprocess
import sys

import pytest

from fleetserve.router import args_check


def test_good_flags_print_what_launch_needs(capsys):
    assert args_check.main(["--policy", "kv_aware", "--prometheus-port", "9100"]) == 0
    assert json.loads(capsys.readouterr().out) == {"policy": "kv_aware", "host": "127.0.0.1", "port": 30000,
                                                   "prometheus_host": "127.0.0.1", "prometheus_port": 9100,
                                                   "warnings": []}
    assert args_check.main(["--host", "127.0.0.1", "--port", "1", "--host=0.0.0.0", "--port", "9000"]) == 0
    out = json.loads(capsys.readouterr().out)  # the last of each, as the router would listen
    assert (out["host"], out["port"]) == ("0.0.0.0", 9000)
    assert args_check.main(["--policy", "random", "--kv-load-weight", "0.5"]) == 0
    assert json.loads(capsys.readouterr().out)["warnings"] == [
        "--kv-load-weight has no effect under --policy random (read only under kv_aware)"]


def test_a_bad_flag_exits_2_with_the_router_parsers_line(capsys):
    with pytest.raises(SystemExit) as e:
        args_check.main(["--retry-max-retries", "0"])
    assert e.value.code == 2
    assert capsys.readouterr().err == "fleetserve router: error: --retry-max-retries must be >= 1 (it counts attempts)\n"


def test_as_a_process_it_binds_nothing_and_exits_at_once():
    out = subprocess.run([sys.executable, "-m", "fleetserve.router.args_check", "--port", "1",
                          "--worker-urls", "http://127.0.0.1:9"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr  # port 1 would need root to bind, and worker :9 is not there
    assert json.loads(out.stdout)["policy"] == "cache_aware"
