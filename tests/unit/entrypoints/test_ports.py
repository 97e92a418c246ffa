"""Ports are checked before anything starts, one line naming the flag."""

import re
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from fleetserve import launch
from fleetserve.bench import sim_worker
from fleetserve.entrypoints import serve
from fleetserve.entrypoints.ports import port_range_error


@pytest.fixture
def busy_port():
    """A port with a listener on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield s.getsockname()[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_port_range_error_names_the_flag():
    assert port_range_error("--port", 30000) is None
    assert port_range_error("--port", 0, allow_zero=True) is None
    assert port_range_error("--port", 0) == "--port must be in 1..65535, got 0"
    assert port_range_error("--port", 70000, allow_zero=True) == \
        "--port must be in 1..65535 (or 0: pick a free port), got 70000"
    assert port_range_error("--worker-base-port", 65534, 3) == \
        "--worker-base-port 65534 + 2 = 65536 is past the last port 65535"
    assert port_range_error("--worker-base-port", 65534, 2) is None


@pytest.mark.parametrize("argv, line", [
    (["--port", "70000"], "sim-worker: --port must be in 1..65535 (or 0: pick a free port), got 70000"),
    (["--port", "-1"], "sim-worker: --port must be in 1..65535 (or 0: pick a free port), got -1"),
    (["--port", "65535", "--num-workers", "2"],
     "sim-worker: --port 65535 + 1 = 65536 is past the last port 65535 (--num-workers 2)"),
    (["--port", "0", "--num-workers", "2"], "sim-worker: --port must be in 1..65535, got 0 (--num-workers 2)"),
])
def test_sim_worker_refuses_ports_out_of_range(capsys, argv, line):
    assert sim_worker.main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines() == [line]


@pytest.mark.parametrize("flag", ["--num-workers", "--stream-interval", "--dp-size"])
def test_sim_worker_names_the_flag_below_one(capsys, flag):
    assert sim_worker.main([flag, "0"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"sim-worker: {flag} must be >= 1, got 0"]


def test_sim_worker_busy_port_names_the_flag(capsys, busy_port):
    assert sim_worker.main(["--port", str(busy_port)]) == 2  # one code for a busy port: serve, router, launch too
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"sim-worker: --port {busy_port}: cannot listen on 127.0.0.1:{busy_port}: Address already in use")


def test_launch_refuses_zero_workers(capsys):
    assert launch.main(["--worker-kind", "sim", "--workers", "0"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == ["fleetserve launch: --workers must be >= 1, got 0"]


def test_sim_worker_port_zero_prints_the_real_port():
    proc = subprocess.Popen([sys.executable, "-m", "fleetserve.cli", "sim-worker", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()
        m = re.search(r"on http://127\.0\.0\.1:(\d+)\.\.(\d+) ", line)
        assert m, line
        port = int(m.group(1))
        assert port > 0 and m.group(2) == m.group(1)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            assert r.status == 200 and r.headers["X-Fleetserve-Worker"] == f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.parametrize("argv, line", [
    (["--port", "70000"], "fleetserve launch: --port must be in 1..65535 (or 0: pick a free port), got 70000"),
    (["--port", "-1"], "fleetserve launch: --port must be in 1..65535 (or 0: pick a free port), got -1"),
    (["--port", "0", "--worker-base-port", "0"], "fleetserve launch: --worker-base-port must be in 1..65535, "
     "got 0 (--workers 2)"),
    (["--worker-base-port", "70000"], "fleetserve launch: --worker-base-port must be in 1..65535, got 70000 "
     "(--workers 2)"),
    (["--worker-base-port", "65535", "--workers", "2"],
     "fleetserve launch: --worker-base-port 65535 + 1 = 65536 is past the last port 65535 (--workers 2)"),
    (["--port", "31001", "--worker-base-port", "31000"],
     "fleetserve launch: --port 31001 is also an instance's port (--worker-base-port 31000 .. 31001)"),
])
def test_launch_refuses_ports_out_of_range(capsys, argv, line):
    assert launch.main(["--worker-kind", "sim", *argv]) == 2
    out = capsys.readouterr()
    assert out.err.strip().splitlines() == [line]
    assert "started" not in out.out  # nothing was started


@pytest.mark.parametrize("flag", ["--port", "--worker-base-port"])
def test_launch_refuses_a_busy_port_before_starting_anything(capsys, busy_port, flag):
    other = "--worker-base-port" if flag == "--port" else "--port"
    other_port = _free_port()  # not busy_port +- k: another process may hold that one
    assert launch.main(["--worker-kind", "sim", "--workers", "1", flag, str(busy_port),
                        other, str(other_port)]) == 2
    out = capsys.readouterr()
    assert out.err.strip().splitlines() == [
        f"fleetserve launch: {flag} {busy_port}: cannot listen on 127.0.0.1:{busy_port}: Address already in use"]
    assert "started" not in out.out


def test_serve_refuses_a_busy_port_before_loading_the_model(capsys, busy_port, monkeypatch, tmp_path):
    def no_load(*_a, **_k):
        raise AssertionError("the model was loaded before the port was checked")

    monkeypatch.setattr(serve, "_start_schedulers", no_load)
    t0 = time.monotonic()
    assert serve.main(["--model-path", str(tmp_path), "--port", str(busy_port)]) == 2
    assert time.monotonic() - t0 < 5
    assert capsys.readouterr().err.strip().splitlines() == [
        f"fleetserve serve: --port {busy_port}: cannot listen on 127.0.0.1:{busy_port}: Address already in use"]


def test_serve_refuses_a_port_out_of_range(capsys):
    assert serve.main(["--port", "70000"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == ["fleetserve serve: --port must be in [0, 65535], got 70000"]
