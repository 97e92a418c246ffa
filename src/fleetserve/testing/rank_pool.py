"""A pool of rank processes that stay up and run many jobs (tests, benchmarks).

Starting a process that imports torch costs seconds on a small machine, so
tests start one pool per world size and run every case in it:

    with RankPool(world_size=2, timeout_s=30) as pool:
        results = pool.run(__file__, "check_tp2", some_arg)   # one result per rank

``pool.run(path_or_module, function_name, *args)`` calls
``function(rank, world_size, *args)`` on every rank at once and returns the
per-rank return values. The function is looked up in a module given by
dotted name or by file path (test files are not importable packages), so it
must be a module-level function; arguments and results must pickle.

The default process group (gloo, ``timeout_s``) is initialised once per
pool; jobs build their own groups on it with
:func:`fleetserve.distributed.groups.build_parallel_state`.

Failures never hang: a job that raises on one rank, a rank that dies, or a
job that takes longer than its ``timeout`` stops the whole pool and raises
(:class:`RankJobError`, :class:`RankFailedError` or ``TimeoutError``); the
next ``run`` starts a fresh pool.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import queue as queue_mod
import sys
import time
import traceback
from typing import Any

from fleetserve.engine.rank_supervisor import RankFailedError, RankSupervisor, free_port


class RankJobError(RuntimeError):
    """A job raised on one rank (the message carries that rank's traceback)."""


_MODULES: dict[str, Any] = {}

# Inside a pool worker: the pool's collective timeout (jobs pass it to the groups they build).
TIMEOUT_S: float = 30.0


def build_state(rank: int, **sizes: Any) -> Any:
    """Inside a job: a ParallelState for ``ParallelConfig(**sizes)`` with the pool's timeout."""
    from fleetserve.distributed.groups import ParallelConfig, build_parallel_state

    return build_parallel_state(ParallelConfig(**sizes), rank, timeout_s=TIMEOUT_S)


def _resolve(where: str, name: str) -> Any:
    mod = _MODULES.get(where)
    if mod is None:
        if where.endswith(".py") or os.sep in where:
            mod_name = "_rank_pool_" + os.path.splitext(os.path.basename(where))[0]
            spec = importlib.util.spec_from_file_location(mod_name, where)
            assert spec is not None and spec.loader is not None, where
            mod = importlib.util.module_from_spec(spec)
            sys.modules[mod_name] = mod
            sys.path.insert(0, os.path.dirname(os.path.abspath(where)))
            spec.loader.exec_module(mod)
        else:
            mod = importlib.import_module(where)
        _MODULES[where] = mod
    return getattr(mod, name)


def _worker(rank: int, world_size: int, init_method: str, timeout_s: float, threads: int,
            jobs: Any, results: Any) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    global TIMEOUT_S
    TIMEOUT_S = timeout_s
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    results.put((rank, -1, "ready", None))
    while True:
        job = jobs.get()
        if job is None:
            break
        job_id, where, name, args = job
        try:
            out = _resolve(where, name)(rank, world_size, *args)
            results.put((rank, job_id, "ok", out))
        except BaseException:  # report everything, then let the parent decide
            results.put((rank, job_id, "error", traceback.format_exc()))
    dist.destroy_process_group()


class RankPool:
    """``world_size`` persistent gloo ranks (see module docstring).

    Args:
        world_size: ranks in the pool.
        timeout_s: process-group timeout (every collective gives up after it).
        threads: torch threads per rank.
        start_timeout_s: seconds allowed for the ranks to start and rendezvous.
    """

    def __init__(self, world_size: int, timeout_s: float = 30.0, threads: int = 1,
                 start_timeout_s: float = 90.0):
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.threads = threads
        self.start_timeout_s = start_timeout_s
        self.launcher: RankSupervisor | None = None
        self._next_id = 0

    # ------------------------------------------------------------------ life
    def start(self) -> "RankPool":
        import multiprocessing as mp

        ctx = mp.get_context("forkserver")
        self._jobs = [ctx.Queue() for _ in range(self.world_size)]
        self._results = ctx.Queue()
        init = f"tcp://127.0.0.1:{free_port()}"
        self.launcher = RankSupervisor(
            _worker, range(self.world_size),
            args_for_rank=lambda r: (self.world_size, init, self.timeout_s, self.threads,
                                     self._jobs[r], self._results),
            preload=("torch", "torch.distributed"), name="rank-pool")
        self.launcher.start()
        self._collect(-1, self.start_timeout_s)
        return self

    def close(self) -> None:
        if self.launcher is None:
            return
        for q in self._jobs:
            try:
                q.put(None)
            except Exception:  # pragma: no cover
                pass
        launcher, self.launcher = self.launcher, None
        try:
            launcher.join(timeout=5.0)
        except (RankFailedError, TimeoutError):
            pass
        launcher.stop()

    def __enter__(self) -> "RankPool":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------- jobs
    def run(self, where: str, name: str, *args: Any, timeout: float = 45.0) -> list[Any]:
        """Run ``where.name(rank, world_size, *args)`` on every rank; per-rank results.

        Raises:
            RankJobError: the job raised on some rank (first failing rank's traceback).
            RankFailedError: a rank process died. TimeoutError: no answer within ``timeout``.
            In all three cases the pool is stopped and restarted by the next call.
        """
        if self.launcher is None:
            self.start()
        self._next_id += 1
        job_id = self._next_id
        for q in self._jobs:
            q.put((job_id, where, name, args))
        return self._collect(job_id, timeout)

    def _collect(self, job_id: int, timeout: float) -> list[Any]:
        assert self.launcher is not None
        deadline = time.monotonic() + timeout
        got: dict[int, Any] = {}
        while len(got) < self.world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                self._abort()
                raise TimeoutError(f"rank pool job {job_id}: ranks {sorted(set(range(self.world_size)) - set(got))} "
                                   f"did not answer within {timeout} s; pool stopped")
            try:
                rank, jid, status, payload = self._results.get(timeout=min(left, 0.2))
            except queue_mod.Empty:
                try:
                    self.launcher.check()
                except RankFailedError:
                    self.launcher = None
                    raise
                continue
            if jid != job_id:
                continue
            if status == "error":
                # A peer's death usually surfaces first as a collective error on a live
                # rank; name the dead rank when there is one.
                launcher = self.launcher
                time.sleep(0.3)
                try:
                    launcher.check()
                except RankFailedError as err:
                    self.launcher = None
                    raise RankFailedError(err.rank, err.pid, err.exitcode,
                                          f"rank {rank} then failed: {payload.strip().splitlines()[-1]}") from None
                self._abort()
                raise RankJobError(f"job {job_id} failed on rank {rank}:\n{payload}")
            got[rank] = payload
        return [got[r] for r in range(self.world_size)]

    def _abort(self) -> None:
        if self.launcher is not None:
            self.launcher.stop()
        self.launcher = None
