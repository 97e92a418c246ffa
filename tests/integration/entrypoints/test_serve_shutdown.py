"""`fleetserve serve` leaves no scheduler process behind, however it is stopped.

SIGTERM: the server stops its children before exiting (uvicorn re-raises the
signal after shutting down, which must not skip the clean-up). SIGKILL: the
scheduler notices its parent is gone and exits by itself within seconds.
"""

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            out += [int(x) for x in f.read().split()]
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][:1] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    end = time.monotonic() + timeout
    while time.monotonic() < end and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


SIGS = (signal.SIGTERM, signal.SIGKILL)


@pytest.fixture(scope="module")
def servers(tiny_llama_dir, tmp_path_factory):
    """``{sig: (process, port, stderr file)}``: one fresh server per case of the test below, all
    started at once so that their start-ups overlap (each case still stops its own server)."""
    out = {}
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        for sig in SIGS:
            port = _free_port()
            err = open(tmp_path_factory.mktemp(f"shutdown_{sig.name}") / "stderr.txt", "w+")
            proc = subprocess.Popen([sys.executable, "-m", "fleetserve.cli", "serve", "--model-path", tiny_llama_dir,
                                     "--port", str(port), "--max-total-tokens", "512", "--log-level", "warning"],
                                    env=env, stdout=subprocess.DEVNULL, stderr=err)
            out[sig] = (proc, port, err)
        yield out
    finally:
        for proc, _, err in out.values():
            err.close()
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.parametrize("sig", SIGS)
def test_no_scheduler_left_after_stop(servers, sig):
    proc, port, err = servers[sig]
    try:
        end = time.monotonic() + 240  # the cases' servers start together: on a busy machine, slowly
        while True:
            assert proc.poll() is None, "server exited during start-up"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < end, "server not healthy in 240 s"
            time.sleep(0.3)
        r = httpx.post(f"http://127.0.0.1:{port}/generate", timeout=60,
                       json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
        assert r.status_code == 200
        children = _children(proc.pid)
        assert children, "expected a scheduler child process"
        proc.send_signal(sig)
        proc.wait(timeout=30)
        assert _wait_gone(children, timeout=10) == []
        if sig == signal.SIGTERM:  # a clean stop leaves no leaked semaphore behind
            time.sleep(0.5)  # the resource tracker reports after the last process is gone
            err.seek(0)
            assert "leaked semaphore" not in err.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
