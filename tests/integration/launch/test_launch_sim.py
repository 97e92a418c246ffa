"""``fleetserve launch`` with simulated instances: serve through the router, restart a
killed instance, stop on SIGTERM leaving no process (checked by PID)."""

import json
import os
import signal
import sys
import threading
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from launch_helpers import LaunchProc, alive, chat, descendants, free_ports, get_json  # noqa: E402


@pytest.mark.timeout(120)
def test_launch_sim_restart_and_clean_stop():
    PORT, BASE = free_ports(2)
    lp = LaunchProc(["--worker-kind", "sim", "--workers", "2", "--port", str(PORT), "--worker-base-port", str(BASE),
                     "--restart-workers", "--shutdown-grace", "10", "--router-args", "--health-check-interval-secs 1",
                     "--stream-interval", "2"])
    try:
        lp.wait_for(r"^\[launch\] 2 instance\(s\) starting; each is ready when it answers /health$", 30)  # stderr
        lp.wait_for(r"^\[launch\] router: waiting for its 2 workers' health checks$", 60)
        lp.wait_for(rf"router ready: http://127\.0\.0\.1:{PORT}", 60)
        lp.wait_for(rf"try: curl http://127\.0\.0\.1:{PORT}/v1/chat/completions", 5)
        url = f"http://127.0.0.1:{PORT}"
        status, body = chat(url, "hello there fleet", max_tokens=5)
        assert status == 200 and body["usage"]["completion_tokens"] == 5
        assert body["worker_id"] in (f"127.0.0.1:{BASE}", f"127.0.0.1:{BASE + 1}")
        first = lp.pids()
        assert set(first) == {"worker0", "worker1", "router"}
        every = set(first.values())
        for p in first.values():
            every |= descendants(p)

        # kill one instance: it is restarted on its port and re-registered
        os.kill(first["worker1"], signal.SIGKILL)
        lp.wait_for(r"worker1 .*exited", 20)
        lp.wait_for(r"worker1 back: re-registered with the router \(status 200\)", 60)
        new_pid = lp.pids()["worker1"]
        assert new_pid != first["worker1"] and alive(new_pid)
        every.add(new_pid)
        every |= descendants(new_pid)
        urls = get_json(url + "/list_workers")["urls"]
        assert sorted(urls) == [f"http://127.0.0.1:{BASE}", f"http://127.0.0.1:{BASE + 1}"]
        served = {chat(url, f"question number {i} " + "x " * (i * 40), max_tokens=2)[1]["worker_id"]
                  for i in range(8)}
        assert f"127.0.0.1:{BASE + 1}" in served  # the restarted instance serves again
    finally:
        code = lp.stop()
    assert code == 0, lp.lines[-20:]
    assert any("all processes stopped" in line for line in lp.lines)
    deadline = time.monotonic() + 10
    while any(alive(p) for p in every) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [p for p in every if alive(p)] == []


@pytest.mark.timeout(120)
def test_launch_says_when_no_instance_is_left_and_the_router_answers_503():
    import urllib.error

    PORT, BASE = free_ports(1)
    lp = LaunchProc(["--worker-kind", "sim", "--workers", "1", "--port", str(PORT), "--worker-base-port", str(BASE),
                     "--shutdown-grace", "10"])
    try:
        lp.wait_for(rf"router ready: http://127\.0\.0\.1:{PORT}", 60)
        url = f"http://127.0.0.1:{PORT}"
        assert chat(url, "hello", max_tokens=2)[0] == 200
        os.kill(lp.pids()["worker0"], signal.SIGKILL)
        lp.wait_for(r"worker0 .*exited", 20)
        lp.wait_for(r"^\[launch\] no instance left: the router answers 503 \(no_healthy_worker\) until one is added",
                    10)
        with pytest.raises(urllib.error.HTTPError) as err:
            chat(url, "hello again", max_tokens=2)
        assert err.value.code == 503
        assert json.loads(err.value.read())["error"]["code"] == "no_healthy_worker"
        assert lp.proc.poll() is None  # launch and its router keep running
    finally:
        code = lp.stop()
    assert code == 0, lp.lines[-20:]



def _launch_one_sim(grace: int) -> tuple[LaunchProc, int]:
    """``fleetserve launch`` of one slow sim instance (k = 20) with ``--shutdown-grace grace``, once ready."""
    port, base = free_ports(1)
    lp = LaunchProc(["--worker-kind", "sim", "--workers", "1", "--port", str(port), "--worker-base-port", str(base),
                     "--shutdown-grace", str(grace), "--stream-interval", "1", "--time-scale", "20"])
    lp.wait_for(rf"router ready: http://127\.0\.0\.1:{port}", 60)
    return lp, port


def _stream_in_background(port: int, max_tokens: int) -> tuple[dict, threading.Thread]:
    """Start a chat stream of ``max_tokens`` through the router on a thread; return once its first chunk
    came.  ``got``: ``first``, ``first_at`` and, when it ends, ``rest`` and ``took`` (seconds), or
    ``error`` for a cut stream (an incomplete chunked read)."""
    import urllib.request

    body = json.dumps({"messages": [{"role": "user", "content": "tell me a long story"}], "max_tokens": max_tokens,
                       "stream": True, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    got: dict = {}

    def read():
        t0 = time.monotonic()
        try:
            with urllib.request.urlopen(req, timeout=90) as r:
                got["first"] = r.readline()
                got["first_at"] = time.monotonic() - t0
                got["rest"] = r.read()
            got["took"] = time.monotonic() - t0
        except Exception as e:
            got["error"] = e

    reader = threading.Thread(target=read)
    reader.start()
    deadline = time.monotonic() + 30
    while "first" not in got and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "first" in got, "no first chunk"
    return got, reader


@pytest.mark.timeout(120)
def test_sigterm_lets_a_stream_in_flight_finish_before_the_instances_stop():
    """SIGTERM to launch while a stream runs: the router is stopped first and waits for the stream, the
    instance still serving it, so the client gets the whole answer and [DONE]; then everything stops.
    (A user trial: every process got SIGTERM at once and the stream ended with ``engine_unavailable``.)"""
    lp, port = _launch_one_sim(20)
    try:
        got, reader = _stream_in_background(port, 40)
        lp.proc.send_signal(signal.SIGTERM)
        reader.join(60)
    finally:
        code = lp.stop()
    assert code == 0, lp.lines[-20:]
    raw = got["first"] + got["rest"]
    assert raw.rstrip().endswith(b"data: [DONE]"), raw[-300:]
    assert b"engine_unavailable" not in raw and raw.count(b'"content"') >= 40
    assert got["took"] - got["first_at"] > 1.0  # the stream really ran on after the signal
    assert any("all processes stopped" in line for line in lp.lines)


@pytest.mark.timeout(120)
def test_a_second_sigterm_to_launch_ends_the_routers_wait_at_once():
    """A second SIGTERM to launch while its router waits for a long stream: the router ends its wait (the
    stream is cut, no [DONE]) and launch is done in seconds, not at the end of --shutdown-grace 60."""
    lp, port = _launch_one_sim(60)
    try:
        got, reader = _stream_in_background(port, 1000)
        lp.proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert lp.proc.poll() is None  # the first one waits for the stream
        t0 = time.monotonic()
        lp.proc.send_signal(signal.SIGTERM)
        code = lp.proc.wait(timeout=30)
        took = time.monotonic() - t0
        reader.join(30)
    finally:
        code = lp.stop()
    assert code == 0, lp.lines[-20:]
    assert took < 15, took  # the stream had ~140 s to go, the grace 60 s
    assert b"[DONE]" not in got.get("rest", b"")
    assert any("again: the router ends its wait" in line for line in lp.lines)
    assert any("all processes stopped" in line for line in lp.lines)
