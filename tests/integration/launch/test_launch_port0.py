"""``fleetserve launch --port 0``: the router gets a free port chosen by the OS, and every
line names that port, never 0."""

import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from launch_helpers import LaunchProc, chat, free_ports  # noqa: E402


@pytest.mark.timeout(120)
def test_port_zero_serves_on_the_port_it_prints():
    _, base = free_ports(1)
    lp = LaunchProc(["--worker-kind", "sim", "--workers", "1", "--port", "0", "--worker-base-port", str(base),
                     "--shutdown-grace", "10"])
    try:
        port = int(lp.wait_for(r"^\[launch\] --port 0: the router will listen on port (\d+)$", 30).group(1))
        assert port != 0 and port != base
        m = lp.wait_for(r"router ready: http://127\.0\.0\.1:(\d+) ", 60)
        assert int(m.group(1)) == port
        status, body = chat(f"http://127.0.0.1:{port}", "hello", max_tokens=2)
        assert status == 200 and body["worker_id"] == f"127.0.0.1:{base}"
    finally:
        code = lp.stop()
    assert code == 0, lp.lines[-20:]
    assert not [x for x in lp.lines if re.search(r"127\.0\.0\.1:0\b", x)]
