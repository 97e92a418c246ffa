"""Start one process per rank and take the whole instance down when one dies.

:class:`RankSupervisor` starts ``target(rank, *args)`` in a fresh process for
each rank (``forkserver`` by default: torch is imported once in the fork
server and each rank forks from it, which is both fast and CUDA-safe). It
watches the processes' sentinels; if any rank exits while the instance should
be running -- an exception, ``os._exit``, a signal, the OOM killer -- it
terminates every other rank (SIGTERM, then SIGKILL after a grace period) and
raises :class:`RankFailedError` naming the rank, its pid and its exit code.
A rank stuck in a collective with a dead peer is therefore never waited on
forever; the process-group timeout is only the second line of defence.

Also here: :func:`free_port` and :func:`replica_init_methods` (one TCP
rendezvous per independent instance replica).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import socket
import threading
import time
from multiprocessing.connection import wait as mp_wait
from typing import Any, Callable, Sequence

logger = logging.getLogger(__name__)


class RankFailedError(RuntimeError):
    """A rank process exited while the instance was running."""

    def __init__(self, rank: int, pid: int | None, exitcode: int | None, detail: str = ""):
        self.rank, self.pid, self.exitcode = rank, pid, exitcode
        how = _describe_exit(exitcode)
        msg = f"rank {rank} (pid {pid}) {how}; the other ranks were stopped"
        if detail:
            msg += f": {detail}"
        super().__init__(msg)


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "is unresponsive"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def replica_init_methods(num_replicas: int, dist_init_addr: str | None = None) -> list[str]:
    """``tcp://host:port`` rendezvous for each instance replica.

    With ``dist_init_addr = "host:port"`` replica ``i`` uses ``port + i`` (so every
    node computes the same addresses); without it, free local ports.
    """
    if dist_init_addr:
        host, _, port = dist_init_addr.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--dist-init-addr must be host:port, got {dist_init_addr!r}")
        return [f"tcp://{host}:{int(port) + i}" for i in range(num_replicas)]
    return [f"tcp://127.0.0.1:{free_port()}" for _ in range(num_replicas)]


class RankSupervisor:
    """Processes for a set of ranks, watched together.

    Args:
        target: module-level function ``target(rank, *args)`` run in each process.
        ranks: the global ranks this node starts (one process each).
        args_for_rank: ``rank -> tuple`` of extra arguments (picklable).
        start_method: ``forkserver`` (default), ``spawn`` or ``fork``.
        preload: modules the fork server imports once (``forkserver`` only).
        grace_s: seconds between SIGTERM and SIGKILL when stopping ranks.
    """

    def __init__(self, target: Callable[..., Any], ranks: Sequence[int],
                 args_for_rank: Callable[[int], tuple] = lambda r: (),
                 start_method: str = "forkserver", preload: Sequence[str] = ("torch",),
                 grace_s: float = 3.0, name: str = "fleetserve-rank"):
        self.target = target
        self.ranks = list(ranks)
        self.args_for_rank = args_for_rank
        self.ctx = mp.get_context(start_method)
        if start_method == "forkserver" and preload:
            self.ctx.set_forkserver_preload(list(preload))
        self.grace_s = grace_s
        self.name = name
        self.procs: dict[int, Any] = {}
        self._stopping = False
        self._watch_thread: threading.Thread | None = None

    # ----------------------------------------------------------------- control
    def start(self) -> "RankSupervisor":
        for r in self.ranks:
            p = self.ctx.Process(target=self.target, args=(r, *self.args_for_rank(r)),
                                 name=f"{self.name}-{r}", daemon=True)
            p.start()
            self.procs[r] = p
        return self

    def check(self) -> None:
        """Raise :class:`RankFailedError` (after stopping the others) if any rank has exited."""
        for r, p in self.procs.items():
            if p.exitcode is not None and not self._stopping:
                self.stop()
                raise RankFailedError(r, p.pid, p.exitcode)

    def wait_any(self, timeout: float | None = None) -> None:
        """Block until some rank exits (then stop all and raise) or ``timeout`` passes."""
        sentinels = {p.sentinel: r for r, p in self.procs.items()}
        ready = mp_wait(list(sentinels), timeout=timeout)
        if ready and not self._stopping:
            r = sentinels[ready[0]]
            p = self.procs[r]
            p.join(0.1)
            self.stop()
            raise RankFailedError(r, p.pid, p.exitcode)

    def join(self, timeout: float | None = None) -> dict[int, int | None]:
        """Wait for every rank to finish on its own; a failing rank stops the rest.

        Returns:
            ``{rank: exitcode}`` (all zero on success).

        Raises:
            RankFailedError: a rank exited non-zero (the others are stopped).
            TimeoutError: not all ranks finished within ``timeout`` (all are stopped).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        pending = dict(self.procs)
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            sentinels = {p.sentinel: r for r, p in pending.items()}
            ready = mp_wait(list(sentinels), timeout=left)
            if not ready:
                self.stop()
                raise TimeoutError(f"ranks {sorted(pending)} still running after {timeout} s; stopped them")
            for s in ready:
                r = sentinels[s]
                p = pending.pop(r)
                p.join(0.1)
                if p.exitcode != 0:
                    self.stop()
                    raise RankFailedError(r, p.pid, p.exitcode)
        return {r: p.exitcode for r, p in self.procs.items()}

    def stop(self) -> None:
        """Terminate every rank still alive (SIGTERM, then SIGKILL after ``grace_s``)."""
        self._stopping = True
        alive = [p for p in self.procs.values() if p.is_alive()]
        for p in alive:
            try:
                p.terminate()
            except Exception:  # pragma: no cover - raced with exit
                pass
        deadline = time.monotonic() + self.grace_s
        for p in alive:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in alive:
            if p.is_alive():
                p.kill()
                p.join(1.0)

    def start_watchdog(self, on_failure: Callable[[RankFailedError], None]) -> threading.Thread:
        """Watch the ranks from a daemon thread; on the first death stop the rest and call
        ``on_failure(err)`` (a server logs it and exits).

        A rank that exits with status 0 or by SIGTERM was asked to stop (shutdown) and
        is not a failure; any other status or signal (SIGKILL, SIGSEGV ...) is.
        """

        def run() -> None:
            pending = dict(self.procs)
            while pending and not self._stopping:
                sentinels = {p.sentinel: r for r, p in pending.items()}
                for s in mp_wait(list(sentinels), timeout=0.5):
                    r = sentinels[s]
                    p = pending.pop(r)
                    p.join(0.1)
                    if p.exitcode not in (0, -signal.SIGTERM) and not self._stopping:
                        err = RankFailedError(r, p.pid, p.exitcode)
                        logger.error("%s", err)
                        self.stop()
                        on_failure(err)
                        return

        t = threading.Thread(target=run, name=f"{self.name}-watchdog", daemon=True)
        t.start()
        self._watch_thread = t
        return t

    def __enter__(self) -> "RankSupervisor":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def exit_instance(err: RankFailedError) -> None:
    """Default ``on_failure`` for servers: end this process with status 1 (the watchdog
    has already logged which rank died and stopped the others)."""
    os._exit(1)
