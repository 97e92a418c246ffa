"""A dead or stuck rank ends the run quickly with a clear error instead of a hang."""

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from fleetserve.engine.rank_supervisor import RankFailedError, RankSupervisor, replica_init_methods
from fleetserve.testing.rank_pool import RankJobError, RankPool


def kill_one_job(rank, world):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    for _ in range(1000):  # rank 0 keeps doing collectives with the dead peer
        dist.all_reduce(torch.ones(1))
    return "unreachable"


def skip_collective_job(rank, world):
    if rank == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins
    else:
        time.sleep(8)
    return rank


def test_killed_rank_fails_fast_and_names_the_rank():
    pool = RankPool(world_size=2, timeout_s=30).start()
    try:
        t0 = time.monotonic()
        with pytest.raises(RankFailedError) as info:
            pool.run(__file__, "kill_one_job", timeout=40)
        elapsed = time.monotonic() - t0
    finally:
        pool.close()
    assert elapsed < 10, elapsed  # well before the 30 s collective timeout
    assert info.value.rank == 1 and info.value.exitcode == -signal.SIGKILL
    assert str(info.value).startswith("rank 1 (pid ") and "killed by SIGKILL" in str(info.value)


def test_collective_with_a_missing_peer_times_out():
    pool = RankPool(world_size=2, timeout_s=2).start()
    try:
        t0 = time.monotonic()
        with pytest.raises(RankJobError, match="(?i)timed out"):
            pool.run(__file__, "skip_collective_job", timeout=30)
        assert time.monotonic() - t0 < 7
    finally:
        pool.close()


def _exit_later(rank, code, delay):
    time.sleep(delay if rank == 1 else 60)
    os._exit(code)


def test_launcher_stops_every_rank_when_one_exits():
    launcher = RankSupervisor(_exit_later, range(3), args_for_rank=lambda r: (3, 0.5), start_method="fork",
                            grace_s=1.0)
    launcher.start()
    t0 = time.monotonic()
    with pytest.raises(RankFailedError, match=r"rank 1 \(pid \d+\) exited with code 3"):
        launcher.join(timeout=30)
    assert time.monotonic() - t0 < 6
    assert all(not p.is_alive() for p in launcher.procs.values())


def test_replica_rendezvous_addresses():
    assert replica_init_methods(3, "10.0.0.5:5000") == ["tcp://10.0.0.5:5000", "tcp://10.0.0.5:5001",
                                                        "tcp://10.0.0.5:5002"]
    local = replica_init_methods(2)
    assert len(set(local)) == 2 and all(a.startswith("tcp://127.0.0.1:") for a in local)
    with pytest.raises(ValueError, match="host:port"):
        replica_init_methods(1, "nohost")
