"""Where a child's output goes under ``fleetserve launch``: this terminal, each line prefixed
with the child's name (``[router] ...``, ``[worker0] ...``), and with ``--log-dir`` also the
child's own file, unprefixed.

A child writes to a pipe; one daemon thread per child copies it line by line. The copy never
stops before the child's end of the pipe closes, even when this terminal is gone (a write
error on stdout is swallowed), so a child never blocks on a full pipe. Children are started
with ``PYTHONUNBUFFERED=1`` (see :func:`child_env`), so their lines arrive as written.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import IO, BinaryIO

_STDOUT_LOCK = threading.Lock()


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
