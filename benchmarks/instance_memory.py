"""Resident memory of one ``fleetserve serve`` instance (the figure in README's "Memory" note
and behind the overheads in ``src/fleetserve/launch/memory.py``).

Starts ``fleetserve serve`` on a free port (extra arguments are passed to it), waits for
``/health``, and prints RSS and PSS per process of the instance (the HTTP process, the
resource tracker, the scheduler / rank processes) and their sums: once idle, once after four
1,500-word greedy chat requests. Then stops it. Prints only; nothing is written.

Usage::

    python benchmarks/instance_memory.py                          # default flags
    python benchmarks/instance_memory.py --max-total-tokens 4096
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def descendants(pid: int) -> list[int]:
    """Live processes below ``pid``, from the ppid field of ``/proc/<n>/stat``."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(d))
    out, stack = [], [pid]
    while stack:
        for c in children.get(stack.pop(), []):
            out.append(c)
            stack.append(c)
    return sorted(out)


def memory_of(pid: int) -> dict[str, int]:
    """``{"Rss": bytes, "Pss": bytes}`` from ``/proc/<pid>/smaps_rollup`` (empty if gone)."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("Rss", "Pss"):
                    out[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def report(label: str, root: int) -> None:
    rows = {pid: memory_of(pid) for pid in [root, *descendants(root)]}
    rss = sum(r.get("Rss", 0) for r in rows.values())
    pss = sum(r.get("Pss", 0) for r in rows.values())
    print(json.dumps({"when": label, "rss_gib": round(rss / 2**30, 3), "pss_gib": round(pss / 2**30, 3),
                      "per_pid_mb": {p: {k: round(v / 1e6) for k, v in r.items()} for p, r in rows.items()}}),
          flush=True)


def main() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
    proc = subprocess.Popen([sys.executable, "-m", "fleetserve.cli", "serve", "--port", str(port),
                             "--disable-uvicorn-access-log", *sys.argv[1:]], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while True:
            if proc.poll() is not None:
                print(f"fleetserve serve exited with code {proc.returncode}", file=sys.stderr)
                return 1
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                print("not healthy within 900 s", file=sys.stderr)
                return 1
            time.sleep(1)
        report("idle", proc.pid)
        for i in range(4):
            body = {"messages": [{"role": "user", "content": f"w{i} " * 1500}], "max_tokens": 64, "temperature": 0}
            req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=600) as r:
                r.read()
        report("after 4 requests", proc.pid)
        return 0
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    sys.exit(main())
