"""Life and death of child processes: end one when the process that launched
it is gone, and leave nothing behind when it ends abruptly.

Scheduler and rank processes are started with ``multiprocessing``'s spawn
context; if the server is killed (SIGKILL, or a signal that skips its clean-up)
they would otherwise live on, holding the model in memory.
"""

from __future__ import annotations

import os
import threading
import time


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
