"""Shared helpers for the launch tests: run ``fleetserve launch``, read PIDs, list descendants."""

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (from /proc ppid links)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(d))
    out, stack = set(), [pid]
    while stack:
        for c in children.get(stack.pop(), []):
            if c not in out:
                out.add(c)
                stack.append(c)
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except OSError:
        return False


class LaunchProc:
    """``fleetserve launch ...`` in a subprocess with its output collected line by line."""

    def __init__(self, args: list[str]):
        import queue
        import threading

        self.proc = subprocess.Popen([sys.executable, "-m", "fleetserve.cli", "launch", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        self.lines: list[str] = []
        self._q: "queue.Queue[str | None]" = queue.Queue()

        def pump():
            for line in self.proc.stdout:
                self._q.put(line.rstrip())
            self._q.put(None)

        self._reader = threading.Thread(target=pump, daemon=True)
        self._reader.start()
        self._eof = False

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        """Read output until a line matches ``pattern``; AssertionError on timeout or exit."""
        import queue

        deadline = time.monotonic() + timeout
        while not self._eof and time.monotonic() < deadline:
            try:
                line = self._q.get(timeout=0.5)
            except queue.Empty:
                continue
            if line is None:
                self._eof = True
                break
            self.lines.append(line)
            m = re.search(pattern, line)
            if m:
                return m
        raise AssertionError(f"no line matching {pattern!r}; output:\n" + "\n".join(self.lines[-40:]))

    def pids(self) -> dict[str, int]:
        """Latest pid per child name from the ``started <name> pid=N`` lines."""
        out = {}
        for line in self.lines:
            m = re.search(r"started (\S+) pid=(\d+)", line)
            if m:
                out[m.group(1)] = int(m.group(2))
        return out

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(timeout=10)
        while not self._q.empty():
            line = self._q.get()
            if line is not None:
                self.lines.append(line)
        return self.proc.returncode


def chat(url: str, content: str, max_tokens: int = 8, timeout: float = 60) -> tuple[int, dict]:
    body = json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                       "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, json.loads(r.read())


def get_json(url: str, timeout: float = 10):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def free_ports(workers: int) -> tuple[int, int]:
    """A free router port and a base port ``b`` with ``b .. b + workers - 1`` free (bound once each, then let go)."""
    import socket

    for _ in range(50):
        socks = []
        try:
            for _ in range(2):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", 0))
            router, base = socks[0].getsockname()[1], socks[1].getsockname()[1]
            if base + workers - 1 > 65535:
                continue
            for p in range(base + 1, base + workers):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            if router in range(base, base + workers):
                continue
            return router, base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports")
