"""``fleetserve launch --kv-events-config``: each instance publishes on its own ports, so both
start, and a kv_aware router subscribes to both streams (issue 12 a)."""

import os
import re
import sys
import time
import urllib.request

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from launch_helpers import LaunchProc, chat, free_ports, get_json  # noqa: E402


def exact_streams(url: str, n: int, within: float) -> tuple[list[str], str]:
    """The workers whose KV-event stream the router at ``url`` trusts ``exact`` (rank 0), polled until
    ``n`` are or ``within`` seconds pass; and the last /metrics text."""
    deadline = time.monotonic() + within
    while True:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        exact = re.findall(r'fleetserve_router_kv_stream_state\{dp_rank="0",state="exact",worker="([^"]+)"\} 1\.0', text)
        if len(exact) >= n or time.monotonic() > deadline:
            return exact, text
        time.sleep(0.3)


@pytest.mark.timeout(240)
def test_two_sim_instances_publish_on_their_own_ports_and_the_router_reads_both():
    PORT, BASE = free_ports(2)
    _, KV = free_ports(2)  # KV and KV + 1 free
    cfg = '{"publisher":"zmq","endpoint":"tcp://*:%d","topic":"kv"}' % KV
    lp = LaunchProc(["--worker-kind", "sim", "--workers", "2", "--port", str(PORT), "--worker-base-port", str(BASE),
                     "--policy", "kv_aware", "--shutdown-grace", "5", "--kv-events-config", cfg])
    try:
        lp.wait_for(rf"router ready: http://127\.0\.0\.1:{PORT}", 120)
        for i in range(2):
            info = get_json(f"http://127.0.0.1:{BASE + i}/get_server_info")
            assert info["kv_events_config"] is not None
            assert re.search(r'"endpoint":\s*"tcp://\*:(\d+)"', info["kv_events_config"]).group(1) == str(KV + i)
        for _ in range(2):  # subscribed before the first event, so both streams start at seq 0
            lp.wait_for(r"kv-events: http://127\.0\.0\.1:\d+ subscribed: rank 0 tcp://127\.0\.0\.1:\d+", 30)
        subscribed = sorted(re.search(r"subscribed: rank 0 tcp://127\.0\.0\.1:(\d+)", line).group(1)
                            for line in lp.lines if "subscribed: rank 0" in line)
        assert subscribed == [str(KV), str(KV + 1)]
        url = f"http://127.0.0.1:{PORT}"
        assert chat(url, "through the router " + "words " * 20, max_tokens=2)[0] == 200
        for i in range(2):  # each instance publishes what it caches, whichever way the router routes
            assert chat(f"http://127.0.0.1:{BASE + i}", f"straight to {i} " + "words " * 20, max_tokens=2)[0] == 200
        exact, text = exact_streams(url, 2, 30)  # both streams received events in order: trust exact
        assert sorted(exact) == [f"http://127.0.0.1:{BASE}", f"http://127.0.0.1:{BASE + 1}"], text[-3000:]
    finally:
        code = lp.stop()
    assert code == 0, lp.lines[-20:]
    assert not any("cannot bind" in line or "exited with code" in line for line in lp.lines), lp.lines[-20:]


@pytest.mark.timeout(240)
def test_kv_aware_launch_without_a_config_gives_the_instances_one_on_free_ports():
    """``--policy kv_aware`` alone: launch gives the instances a publisher on the first free range from
    5557 (vLLM's and SGLang's default port), skipping a port another program holds, and the router's
    streams go exact, so it routes on events instead of staying on its approximate tree."""
    import socket

    PORT, BASE = free_ports(2)
    hold = socket.socket()
    try:
        hold.bind(("0.0.0.0", 5557))
        hold.listen()
        held = True
    except OSError:  # another program has it already: skipped all the same
        held = False
    lp = LaunchProc(["--worker-kind", "sim", "--workers", "2", "--port", str(PORT), "--worker-base-port", str(BASE),
                     "--policy", "kv_aware", "--shutdown-grace", "5"])
    try:
        lp.wait_for(rf"router ready: http://127\.0\.0\.1:{PORT}", 120)
        note = next(line for line in lp.lines if "the instances publish KV-cache events" in line)
        first = int(re.search(r"tcp://\*:(\d+)", note).group(1))
        assert first > 5557 if held else first >= 5557
        for i in range(2):
            info = get_json(f"http://127.0.0.1:{BASE + i}/get_server_info")
            assert re.search(r'"endpoint":\s*"tcp://\*:(\d+)"', info["kv_events_config"]).group(1) == str(first + i)
        for _ in range(2):  # subscribed before the first event, so both streams start at seq 0
            lp.wait_for(r"kv-events: http://127\.0\.0\.1:\d+ subscribed: rank 0 tcp://127\.0\.0\.1:\d+", 30)
        url = f"http://127.0.0.1:{PORT}"
        for i in range(2):
            assert chat(f"http://127.0.0.1:{BASE + i}", f"straight to {i} " + "words " * 20, max_tokens=2)[0] == 200
        exact, text = exact_streams(url, 2, 30)  # both streams received events in order: trust exact
        assert sorted(exact) == [f"http://127.0.0.1:{BASE}", f"http://127.0.0.1:{BASE + 1}"], text[-3000:]
    finally:
        code = lp.stop()
        hold.close()
    assert code == 0, lp.lines[-20:]
