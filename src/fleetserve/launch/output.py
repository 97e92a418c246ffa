"""Where a child's output goes under ``fleetserve launch``: this terminal, each line prefixed
with the child's name (``[router] ...``, ``[worker0] ...``), and with ``--log-dir`` also the
child's own file, unprefixed.

A child writes to a pipe; one daemon thread per child copies it line by line. The copy never
stops before the child's end of the pipe closes, even when this terminal is gone (a write
error on stdout is swallowed), so a child never blocks on a full pipe. Children are started
with ``PYTHONUNBUFFERED=1`` (see :func:`child_env`), so their lines arrive as written.

The launcher's own lines go through :func:`say`, under the same lock as the copies and as one
write: ``print`` writes the text and its newline in two calls, and a child's line copied
between them would be glued to the launcher's (``[launch] SIGTERM: stopping[worker0] ...``).
stdout and stderr share the lock, since a terminal or a ``2>&1`` pipe puts them on one stream.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import IO, BinaryIO

# re-entrant: a signal handler that says a line may run while the main thread holds it in say()
_STDOUT_LOCK = threading.RLock()


def say(line: str, err: bool = False) -> None:
    """Write ``line`` and its newline to stdout (stderr when ``err``) in one write, flushed,
    under the lock the child copies hold, so no child's line lands inside it. A closed or
    broken stream is ignored, as in :func:`copy_lines`."""
    try:
        with _STDOUT_LOCK:
            stream = sys.stderr if err else sys.stdout
            stream.write(line + "\n")
            stream.flush()
    except (OSError, ValueError):
        pass


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


def copy_lines(name: str, src: BinaryIO, log: Path | None = None, out: IO[str] | None = None) -> None:
    """Copy ``src`` until EOF: each line to ``out`` (default ``sys.stdout``) as
    :func:`prefixed`, and as it is to ``log`` (appended) when given. Closes ``src``."""
    sink = open(log, "ab") if log else None
    try:
        for line in iter(src.readline, b""):
            if sink is not None:
                sink.write(line)
                sink.flush()
            try:
                with _STDOUT_LOCK:
                    stream = out or sys.stdout
                    stream.write(prefixed(name, line))
                    stream.flush()
            except (OSError, ValueError):  # terminal gone (EIO / EPIPE) or stdout closed: keep draining
                pass
    finally:
        src.close()
        if sink is not None:
            sink.close()


def start_copy(name: str, src: BinaryIO, log: Path | None = None) -> threading.Thread:
    """:func:`copy_lines` in a daemon thread (started); join it to wait for the child's last line."""
    t = threading.Thread(target=copy_lines, args=(name, src, log), name=f"output-{name}", daemon=True)
    t.start()
    return t
