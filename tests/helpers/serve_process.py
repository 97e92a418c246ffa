"""Run ``fleetserve serve`` (or any server command) as a real process for a test, until it is healthy."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time

import httpx
import pytest


@contextlib.contextmanager
def serve_process(cmd: list[str], base: str, log, env: dict | None = None, startup_timeout: float = 180):
    """Start ``cmd`` in its own session with output to ``log`` (a file opened ``w+``), wait until
    ``base + "/health"`` answers 200 (``pytest.fail`` with the log's tail if it exits or the
    ``startup_timeout`` in seconds passes), yield ``base``, then SIGTERM the session (SIGKILL after 15 s)."""
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + startup_timeout
    try:
        while True:
            if proc.poll() is not None:
                log.seek(0)
                pytest.fail(f"server exited with {proc.returncode}:\n{log.read()[-3000:]}")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("server did not become healthy in time")
            time.sleep(0.5)
        yield base
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
