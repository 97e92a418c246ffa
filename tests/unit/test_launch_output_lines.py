"""The launcher's own lines and its children's copied lines never share a line on the
terminal: ``say`` writes a whole line under the lock the copies hold (the CI failure this
pins: ``[launch] SIGTERM: stopping`` printed with ``print``, a worker's access line copied
between its text and its newline)."""

import os
import sys
import threading
import time

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


def test_launcher_lines_and_child_lines_stay_whole(monkeypatch):
    stream = SlowStream()
    monkeypatch.setattr(sys, "stdout", stream)
    monkeypatch.setattr(sys, "stderr", stream)  # one terminal, as under 2>&1
    r, w = os.pipe()
    n = 150

    def child():
        with os.fdopen(w, "wb") as f:
            for i in range(n):
                f.write(f"access line {i}\n".encode())
                f.flush()
                time.sleep(0.0002)

    feeder = threading.Thread(target=child)
    copier = output.start_copy("worker0", os.fdopen(r, "rb"))
    feeder.start()
    for i in range(n):
        output.say(f"[launch] note {i}", err=bool(i % 2))
    feeder.join(10)
    copier.join(10)
    assert not copier.is_alive()

    assert all(s.endswith("\n") and s.count("\n") == 1 for s in stream.writes), \
        [s for s in stream.writes if not s.endswith("\n") or s.count("\n") != 1][:5]
    lines = "".join(stream.writes).splitlines()
    assert sorted(lines) == sorted([f"[worker0] access line {i}" for i in range(n)]
                                   + [f"[launch] note {i}" for i in range(n)])
    # each source's lines keep their order
    assert [x for x in lines if x.startswith("[launch]")] == [f"[launch] note {i}" for i in range(n)]


def test_say_survives_a_closed_stream(monkeypatch):
    class Closed:
        def write(self, s):
            raise ValueError("I/O operation on closed file")

        def flush(self):
            pass

    monkeypatch.setattr(sys, "stdout", Closed())
    output.say("[launch] gone")  # no exception: the launcher keeps stopping its children


def test_say_from_a_signal_handler_inside_say_does_not_deadlock(monkeypatch):
    """The launcher's SIGINT handler says a line; the signal may arrive while the main
    thread is inside ``say`` holding the lock."""
    stream = SlowStream()
    monkeypatch.setattr(sys, "stdout", stream)
    inner = []

    class Reentrant(SlowStream):
        def write(self, s):
            if not inner:
                inner.append(1)
                output.say("[launch] SIGINT: stopping")  # what a handler run here would do
            return stream.write(s)

    monkeypatch.setattr(sys, "stdout", Reentrant())
    done = threading.Event()
    t = threading.Thread(target=lambda: (output.say("[launch] outer"), done.set()), daemon=True)
    t.start()
    assert done.wait(5), "say deadlocked when re-entered"
    assert stream.writes == ["[launch] SIGINT: stopping\n", "[launch] outer\n"]
