"""A busy --port (or --prometheus-port) stops the router at once with one line, before any worker wait."""

import socket
import subprocess
import sys
import time

import pytest


def _run_router(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "fleetserve.cli", "router", *args], capture_output=True, text=True,
                       timeout=60)
    return p, time.monotonic() - t0


@pytest.mark.timeout(90)
@pytest.mark.parametrize("flag", ["--port", "--prometheus-port"])
def test_a_busy_port_is_one_line_and_a_nonzero_exit(flag):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        free = socket.socket()
        free.bind(("127.0.0.1", 0))
        other = free.getsockname()[1]
        free.close()
        args = ["--port", str(port)] if flag == "--port" else ["--port", str(other), "--prometheus-port", str(port)]
        # a worker that never answers: without the up-front check the router would wait for it first
        p, took = _run_router(*args, "--worker-urls", "http://127.0.0.1:9", "--worker-startup-timeout-secs", "600")
    out = (p.stdout + p.stderr).strip().splitlines()
    assert p.returncode == 2  # a start-up error, as launch, serve and sim-worker answer a busy port
    assert "Traceback" not in p.stderr
    assert len(out) == 1, out
    flags = "--host/--port" if flag == "--port" else "--prometheus-host/--prometheus-port"
    assert out[0].endswith(f"cannot listen on 127.0.0.1:{port} ({flags}): address already in use")
    assert took < 30
