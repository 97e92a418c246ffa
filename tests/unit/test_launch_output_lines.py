"""The launcher's terminal (``launch/output.py``): its own lines and its children's copied
lines never share a line, and a terminal that does not read never stops the fleet.

Pins two faults: ``[launch] SIGTERM: stopping`` printed with ``print`` had a worker's access line
copied between its text and its newline (a CI failure); and with a pager that did not read, a copy
thread blocked in the full pipe while holding the lock that the SIGTERM handler then waited for
(the launcher ignored the signal, and the children blocked on their own full pipes)."""

import os
import sys
import threading
import time

import pytest

from fleetserve.launch import output


class SlowStream:
    """A text stream that records each ``write`` call and yields the CPU inside it, so a
    line written in two calls leaves a window another thread would use."""

    def __init__(self):
        self.writes: list[str] = []

    def write(self, s: str) -> int:
        self.writes.append(s)
        time.sleep(0.0005)
        return len(s)

    def flush(self) -> None:
        pass


class StuckStream(SlowStream):
    """A terminal nobody reads: ``write`` blocks until ``release`` is set."""

    def __init__(self):
        super().__init__()
        self.release = threading.Event()

    def write(self, s: str) -> int:
        self.release.wait(30)
        return super().write(s)


@pytest.fixture
def term(monkeypatch):
    """A fresh terminal in place of the module's (its writer thread is a daemon)."""
    t = output.Terminal(max_pending=50)
    monkeypatch.setattr(output, "terminal", t)
    return t


def _child(w: int, lines: list[bytes]):
    def run():
        with os.fdopen(w, "wb") as f:
            for line in lines:
                f.write(line)
                f.flush()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_launcher_lines_and_child_lines_stay_whole(monkeypatch, term):
    term.max_pending = 10_000
    stream = SlowStream()
    monkeypatch.setattr(sys, "stdout", stream)
    monkeypatch.setattr(sys, "stderr", stream)  # one terminal, as under 2>&1
    r, w = os.pipe()
    n = 150
    feeder = _child(w, [f"access line {i}\n".encode() for i in range(n)])
    copier = output.start_copy("worker0", os.fdopen(r, "rb"))
    for i in range(n):
        output.say(f"[launch] note {i}", err=bool(i % 2))
    feeder.join(10)
    copier.join(10)
    assert not copier.is_alive()
    assert output.drain(10)

    assert all(s.endswith("\n") and s.count("\n") == 1 for s in stream.writes), \
        [s for s in stream.writes if not s.endswith("\n") or s.count("\n") != 1][:5]
    lines = "".join(stream.writes).splitlines()
    assert sorted(lines) == sorted([f"[worker0] access line {i}" for i in range(n)]
                                   + [f"[launch] note {i}" for i in range(n)])
    # each source's lines keep their order
    assert [x for x in lines if x.startswith("[launch]")] == [f"[launch] note {i}" for i in range(n)]
    assert [x for x in lines if x.startswith("[worker0]")] == [f"[worker0] access line {i}" for i in range(n)]


def test_a_terminal_that_does_not_read_blocks_neither_the_child_nor_the_launcher(monkeypatch, term):
    stream = StuckStream()
    monkeypatch.setattr(sys, "stdout", stream)
    r, w = os.pipe()
    line = b"x" * 200 + b"\n"
    n = 2000  # 400 KB: far past a pipe's 64 KiB, so the child would block if nobody drained its pipe
    feeder = _child(w, [line] * n)
    copier = output.start_copy("worker0", os.fdopen(r, "rb"))
    feeder.join(10)
    assert not feeder.is_alive(), "the child blocked on its output"
    copier.join(10)
    assert not copier.is_alive()

    t0 = time.monotonic()
    output.say("[launch] SIGTERM: stopping")  # what the signal handler does
    assert time.monotonic() - t0 < 0.5
    # 50 lines taken (the one the writer is stuck on counts), the rest (the launcher's line too) not shown
    assert term.dropped == n + 1 - 50 and term.queued - term.written == 50

    stream.release.set()  # the terminal reads again
    assert output.drain(10)
    text = "".join(stream.writes)
    assert text.count("[worker0] " + "x" * 200 + "\n") == 50
    assert text.endswith(f"[launch] {n + 1 - 50} output line(s) not shown: this terminal did not read them in "
                         "time (--log-dir keeps every child's lines)\n")


def test_lines_to_a_closed_stdout_are_lost_and_nothing_fails(monkeypatch, term):
    monkeypatch.setattr(sys, "stdout", None)  # started with >&-

    class Closed:
        def write(self, s):
            raise ValueError("I/O operation on closed file")

        def flush(self):
            pass

    monkeypatch.setattr(sys, "stderr", Closed())
    output.say("[launch] gone")
    output.say("[launch] gone too", err=True)
    assert output.drain(5) and term.written == 2


def test_drain_without_a_line_returns_at_once(term):
    t0 = time.monotonic()
    assert output.drain(5) and time.monotonic() - t0 < 0.5
