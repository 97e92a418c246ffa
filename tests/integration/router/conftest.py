"""Process helpers for the router's end-to-end tests: fake workers and a router, on loopback."""

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
FAKE = HERE / "fake_llm_worker.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float = 20.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            proc.log.seek(0)
            tail = proc.log.read()[-2000:].decode(errors="replace")
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered:\n{tail}")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{url} did not answer 200 within {timeout} s")


class Procs:
    """Starts processes and ends exactly those, by pid."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def spawn(self, args: list[str], env: dict | None = None) -> subprocess.Popen:
        log = tempfile.TemporaryFile()
        p = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        p.log = log
        self.procs.append(p)
        return p

    def worker(self, name: str, unhealthy_file: str | None = None) -> tuple[str, subprocess.Popen]:
        port = free_port()
        args = [sys.executable, str(FAKE), "--port", str(port), "--name", name]
        if unhealthy_file:
            args += ["--unhealthy-file", unhealthy_file]
        p = self.spawn(args)
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/stats", proc=p)
        return url, p

    def sim_with_events(self, *extra: str, dp_size: int = 1) -> str:
        """A ``fleetserve sim-worker`` publishing KV events (ZMQ, with a replay endpoint), up: its URL.
        ``dp_size``: its DP ranks (rank r publishes at the endpoint's port + r, replays at the replay's + r)."""
        import json

        from helpers.kv_events_sub import free_port_block

        http, ev = free_port_block(1), free_port_block(2 * dp_size)
        cfg = {"publisher": "zmq", "endpoint": f"tcp://*:{ev}", "replay_endpoint": f"tcp://*:{ev + dp_size}"}
        p = self.spawn([sys.executable, "-m", "fleetserve.cli", "sim-worker", "--port", str(http), "--dp-size",
                        str(dp_size), "--kv-events-config", json.dumps(cfg), *extra])
        url = f"http://127.0.0.1:{http}"
        wait_http(url + "/health", timeout=60, proc=p)
        return url

    def router(self, worker_urls: list[str], *extra: str) -> tuple[str, subprocess.Popen]:
        port = free_port()
        args = [sys.executable, "-m", "fleetserve.cli", "router", "--host", "127.0.0.1", "--port", str(port),
                "--log-level", "warn", "--worker-startup-check-interval", "0.1", *extra]
        if worker_urls:
            args += ["--worker-urls", *worker_urls]
        p = self.spawn(args)
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health", proc=p)
        return url, p

    def engine(self, *extra: str, timeout: float = 240.0) -> tuple[str, subprocess.Popen]:
        """A real ``fleetserve serve`` instance (default model), torch limited to 2 threads."""
        url, p = self.spawn_engine(*extra)
        wait_http(url + "/health", timeout=timeout, proc=p)
        return url, p

    def spawn_engine(self, *extra: str) -> tuple[str, subprocess.Popen]:
        """As :meth:`engine`, without waiting for it (its own process group: ``os.killpg(p.pid, ...)``)."""
        port = free_port()
        env = dict(os.environ, OMP_NUM_THREADS="2")
        p = self.spawn([sys.executable, "-m", "fleetserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                        *extra], env=env)
        return f"http://127.0.0.1:{port}", p

    def wait_engine(self, url: str, p: subprocess.Popen, timeout: float = 240.0) -> None:
        """Wait for a :meth:`spawn_engine` instance's ``/health``."""
        wait_http(url + "/health", timeout=timeout, proc=p)

    def kill(self, p: subprocess.Popen) -> None:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=10)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.kill(p.pid, signal.SIGKILL)
                p.wait(timeout=5)
            p.log.close()


def _procs():
    ps = Procs()
    try:
        yield ps
    finally:
        ps.close()


procs = pytest.fixture(_procs, name="procs")
procs.__doc__ = "Processes one test starts, stopped when it ends."
#: As ``procs``, for processes a whole test module shares (e.g. real engines, slow to start).
module_procs = pytest.fixture(_procs, scope="module", name="module_procs")
#: As ``procs``, for processes the whole session shares (the shared engines below).
session_procs = pytest.fixture(_procs, scope="session", name="session_procs")


@pytest.fixture(scope="session")
def smollm2_p16_engine(session_procs) -> tuple[str, subprocess.Popen]:
    """``(url, process)`` of ONE real ``fleetserve serve`` (built-in SmolLM2, ``--max-total-tokens
    4096 --page-size 16``, KV events on ZMQ with a replay endpoint), started on first use and shared
    by the router tests that need "a real engine" and never stop it
    (``test_router_kv_aware_publishers_e2e.py``, ``test_router_migration_engine_e2e.py``'s B): a start
    costs about 20 s of CPU. Tests run one at a time and wait for its load to return to zero."""
    import json

    from helpers.kv_events_sub import free_port_block

    ev = free_port_block(2)
    cfg = {"publisher": "zmq", "endpoint": f"tcp://*:{ev}", "replay_endpoint": f"tcp://*:{ev + 1}"}
    url, p = session_procs.spawn_engine("--max-total-tokens", "4096", "--page-size", "16",
                                        "--kv-events-config", json.dumps(cfg))
    session_procs.wait_engine(url, p, timeout=400)
    return url, p
