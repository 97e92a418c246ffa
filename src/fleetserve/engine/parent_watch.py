"""Life and death of child processes: end one when the process that launched
it is gone, and leave nothing behind when it ends abruptly.

Scheduler and rank processes are started with ``multiprocessing``'s spawn
context; if the server is killed (SIGKILL, or a signal that skips its clean-up)
they would otherwise live on, holding the model in memory.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def set_parent_death_signal(sig: int = signal.SIGTERM, parent_pid: int | None = None) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent dies (``prctl(PR_SET_PDEATHSIG)``).

    Meant for ``subprocess.Popen(preexec_fn=...)``: it covers the parent's SIGKILL, which no clean-up
    in the parent can. ``parent_pid``: the expected parent; if it is already gone (it died before the
    call), ``sig`` is sent at once. The signal fires when the *thread* that started the child exits,
    so start children from a thread that lives as long as the parent (the main thread).
    Returns False where unsupported (not Linux, no libc).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)
    return True


def parent_gone(parent_pid: int) -> bool:
    """True when ``parent_pid`` no longer exists or is a zombie."""
    try:
        os.kill(parent_pid, 0)
        with open(f"/proc/{parent_pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][:1] == "Z"
    except (ProcessLookupError, PermissionError, FileNotFoundError):
        return True
    except OSError:  # no /proc: trust kill(0)
        return False


def exit_with_parent(parent_pid: int, every_s: float = 1.0) -> threading.Thread:
    """Start a daemon thread that calls ``os._exit(0)`` within ``every_s`` seconds of
    ``parent_pid`` disappearing. Returns the thread."""

    def watch() -> None:
        while True:
            time.sleep(every_s)
            if parent_gone(parent_pid):
                os._exit(0)

    t = threading.Thread(target=watch, name="parent-watch", daemon=True)
    t.start()
    return t


def no_leaks_on_abrupt_exit() -> None:
    """Prepare a child that ends by ``os._exit`` or by SIGTERM's default action.

    Both skip multiprocessing's finalizers, so a named semaphore created in the
    child is reported as leaked by the resource tracker at shutdown. The one we
    create is tqdm's default lock (a multiprocessing RLock, made on the first
    progress bar); a thread lock is all one process needs, so use that.
    """
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
