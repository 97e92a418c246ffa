"""Check the router's command line (launch's flags plus ``--router-args``) before any instance starts.

The router's own parser and config checks run in a short-lived child process,
``python -m fleetserve.router.args_check`` (the launcher imports nothing of the router: the
router is a wing of its own, docs/architecture.md), which starts nothing. A bad value is then
refused in one line naming ``--router-args`` and the router's flag, exit 2, instead of after
every instance is up (minutes for engines).
"""

from __future__ import annotations

import json
import subprocess
import sys


def check_router_args(router_argv: list[str], timeout: float = 60.0) -> tuple[str | None, dict]:
    """``(error, info)`` for the router flags ``router_argv`` (what follows ``fleetserve router``).

    ``error``: one line, ``--router-args: <the router's message>`` (None when the flags are good);
    ``info``: the checker's JSON (``policy``, ``prometheus_host``, ``prometheus_port``) when good, else ``{}``.
    A checker that does not answer within ``timeout`` seconds, or answers nothing readable, is an error too.
    """
    cmd = [sys.executable, "-m", "fleetserve.router.args_check", *router_argv]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return f"--router-args: the router's flag check gave no answer within {timeout:g} s", {}
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or [f"exit code {done.returncode}"]
        msg = lines[-1]
        _, sep, rest = msg.partition("error: ")
        return f"--router-args: {rest if sep else msg}", {}
    try:
        return None, json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return f"--router-args: the router's flag check printed no result: {done.stdout.strip()[:200]!r}", {}
