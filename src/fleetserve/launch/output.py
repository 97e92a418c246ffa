"""Where a child's output goes under ``fleetserve launch``: this terminal, each line prefixed
with the child's name (``[router] ...``, ``[worker0] ...``), and with ``--log-dir`` also the
child's own file, unprefixed.

A child writes to a pipe; one daemon thread per child copies it line by line (:func:`copy_lines`).
Children are started with ``PYTHONUNBUFFERED=1`` (see :func:`child_env`), so their lines arrive
as written.

Every line meant for this terminal, a child's or the launcher's own (:func:`say`), goes into one
bounded queue (:class:`Terminal`), and one daemon thread writes the queue out, a whole line per
write, in the order the lines came.  So:

- no two lines share a line on the terminal (``print`` writes a text and its newline in two
  calls; a child's line copied between them was glued to the launcher's);
- a terminal that does not read (a paused pager, ``| less`` never scrolled, a stuck log reader)
  blocks only the writer thread: the copies keep draining the children's pipes, so no child
  blocks on its output, and the launcher's main thread and its signal handler never wait for the
  terminal, so SIGINT / SIGTERM still stop the fleet.  Past :data:`MAX_PENDING_LINES` lines
  waiting, further lines are not shown (counted, and said once the terminal reads again); the
  ``--log-dir`` files get every line all the same;
- a closed or broken terminal (``>&-``, EPIPE after ``| head``) loses the lines, nothing else.

:func:`drain` waits (bounded) until what was queued is written: ``fleetserve launch`` calls it
before it returns.
"""

from __future__ import annotations

import itertools
import os
import queue
import sys
import threading
from pathlib import Path
from typing import BinaryIO

MAX_PENDING_LINES = 10_000  # lines waiting for the terminal; later ones are dropped (counted) until it reads
DRAIN_S = 5.0  # how long the launcher waits for its last lines to reach the terminal before it exits


def child_env() -> dict[str, str]:
    """This process's environment plus ``PYTHONUNBUFFERED=1``: a Python child behind a pipe
    would otherwise hold its ``print`` output in a 8 KiB buffer."""
    return dict(os.environ, PYTHONUNBUFFERED="1")


def prefixed(name: str, line: bytes) -> str:
    """``b"INFO: up\\n" -> "[name] INFO: up\\n"``; undecodable bytes become U+FFFD, and a last
    line without its newline gets one."""
    text = line.decode("utf-8", errors="replace")
    if not text.endswith("\n"):
        text += "\n"
    return f"[{name}] {text}"


def _write(text: str, err: bool) -> None:
    """One whole line to stdout (stderr when ``err``), whichever stream ``sys`` names now.  The
    process's own streams are written at their file descriptor, past their Python buffer: a
    writer thread stuck in a full pipe then holds no lock the interpreter needs at exit.  A
    missing, closed or broken stream loses the line."""
    stream = sys.stderr if err else sys.stdout
    if stream is None:  # started with the descriptor closed (>&-)
        return
    try:
        if stream is sys.__stdout__ or stream is sys.__stderr__:
            data = text.encode(stream.encoding or "utf-8", "replace")
            fd = stream.fileno()
            while data:
                data = data[os.write(fd, data):]
        else:  # a stream put in its place (a test's capture, a wrapper): its own write
            stream.write(text)
            stream.flush()
    except (OSError, ValueError):  # EPIPE / EIO (terminal gone), closed, no descriptor
        pass


class Terminal:
    """This process's stdout and stderr behind a bounded queue and one writer thread (see the
    module docstring).  :meth:`emit` never blocks and may be called from any thread and from a
    signal handler (``queue.SimpleQueue.put`` is reentrant; the counters are ``itertools.count``,
    whose ``next`` is atomic)."""

    def __init__(self, max_pending: int = MAX_PENDING_LINES) -> None:
        self.max_pending = max_pending
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._queued = itertools.count(1)
        self._drops = itertools.count(1)
        self.queued = 0  # lines queued so far (about: threads may race on the assignment, not on the count)
        self.written = 0  # lines the writer took off the queue (written, or lost to a broken stream)
        self.dropped = 0  # lines not shown because too many were waiting
        self._said_dropped = 0
        self._thread: threading.Thread | None = None

    def emit(self, text: str, err: bool = False) -> None:
        """Queue ``text`` (whole lines, newline included) for stdout, stderr when ``err``."""
        if self.queued - self.written >= self.max_pending:
            self.dropped = next(self._drops)
            return
        self.queued = next(self._queued)
        self._q.put((text, err))
        if self._thread is None:
            self.start()

    def start(self) -> None:
        """Start the writer thread (once)."""
        if self._thread is not None:
            return
        t = threading.Thread(target=self._run, name="launch-terminal", daemon=True)
        self._thread = t
        t.start()

    def drain(self, timeout: float = DRAIN_S) -> bool:
        """Wait until every line queued before this call is written; False after ``timeout`` s."""
        if self._thread is None:
            return True
        done = threading.Event()
        self._q.put(done)
        return done.wait(timeout)

    def _run(self) -> None:
        q = self._q
        while True:
            item = q.get()
            drained = item if isinstance(item, threading.Event) else None
            if drained is None:
                _write(*item)
                self.written += 1
            dropped = self.dropped
            if dropped > self._said_dropped and (drained is not None or q.empty()):  # it reads again
                _write(f"[launch] {dropped - self._said_dropped} output line(s) not shown: this terminal did "
                       "not read them in time (--log-dir keeps every child's lines)\n", False)
                self._said_dropped = dropped
            if drained is not None:
                drained.set()


terminal = Terminal()


def say(line: str, err: bool = False) -> None:
    """The launcher's own ``line`` (one or more lines; a newline is added) to stdout, stderr
    when ``err``, through :data:`terminal`: it never blocks, and never lands inside a child's line."""
    terminal.emit(line + "\n", err)


def drain(timeout: float = DRAIN_S) -> bool:
    """:meth:`Terminal.drain` of :data:`terminal`."""
    return terminal.drain(timeout)


def copy_lines(name: str, src: BinaryIO, log: Path | None = None) -> None:
    """Copy ``src`` until EOF: each line to the terminal as :func:`prefixed` (through
    :data:`terminal`, so this never waits for the terminal), and as it is to ``log`` (appended)
    when given. Closes ``src``."""
    sink = open(log, "ab") if log else None
    try:
        for line in iter(src.readline, b""):
            if sink is not None:
                sink.write(line)
                sink.flush()
            terminal.emit(prefixed(name, line))
    finally:
        src.close()
        if sink is not None:
            sink.close()


def start_copy(name: str, src: BinaryIO, log: Path | None = None) -> threading.Thread:
    """:func:`copy_lines` in a daemon thread (started); join it to wait for the child's last line."""
    t = threading.Thread(target=copy_lines, args=(name, src, log), name=f"output-{name}", daemon=True)
    t.start()
    return t
