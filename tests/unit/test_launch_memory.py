"""``fleetserve launch``'s memory estimate and its refusal of a fleet that does not fit
(the available-memory figure injected, so nothing heavy starts)."""

import socket
import subprocess
import sys

import pytest

from fleetserve import launch
from fleetserve.engine.args import ServerArgs
from fleetserve.launch import memory

MIB, GIB = 1 << 20, 1 << 30
OVERHEAD = memory.FRONT_OVERHEAD_BYTES + memory.RANK_OVERHEAD_BYTES


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_builtin_model_sizes():
    # SmolLM2-135M: 134,515,008 parameters (tied embeddings) + the 128-byte rotary buffer, 4 bytes each;
    # KV per token = 2 (K, V) x 30 layers x 3 KV heads x head dim 64 x 4 bytes.
    weights, kv = memory.model_sizes(None, "float32")
    assert weights == 134_515_008 * 4 + 128
    assert kv == 2 * 30 * 3 * 64 * 4 == 46080
    weights16, kv16 = memory.model_sizes(None, "bfloat16")
    assert kv16 == kv // 2 and weights16 < weights


def test_estimate_with_max_total_tokens():
    est = memory.estimate_instance(ServerArgs(max_total_tokens=1000), 20 * GIB, 500 * MIB, 46080)
    assert (est.ranks, est.weights_bytes, est.kv_pool_bytes) == (1, 500 * MIB, 46_080_000)
    assert est.total_bytes == 500 * MIB + 46_080_000 + OVERHEAD


def test_estimate_default_pool_is_the_engines_share_of_available_memory():
    est = memory.estimate_instance(ServerArgs(), 20 * GIB, 500 * MIB, 46080)
    assert est.kv_pool_bytes == int(20 * GIB * 0.1)  # DEFAULT_CPU_KV_FRACTION
    est = memory.estimate_instance(ServerArgs(mem_fraction_static=0.3), 20 * GIB, 500 * MIB, 46080)
    assert est.kv_pool_bytes == int(20 * GIB * 0.3)
    est = memory.estimate_instance(ServerArgs(), 1 << 50, 500 * MIB, 46080)  # capped at MAX_AUTO_TOKENS
    assert est.kv_pool_bytes == (1 << 20) * 46080


def test_estimate_counts_every_rank():
    # tp 2 x dp 2 without DP attention: 4 ranks, each with half the weights and half of each token's KV
    est = memory.estimate_instance(ServerArgs(tp_size=2, dp_size=2, max_total_tokens=1000), 20 * GIB, 400 * MIB, 46080)
    assert est.ranks == 4
    assert est.weights_bytes == 4 * 200 * MIB and est.kv_pool_bytes == 4 * 1000 * 23040
    assert est.overhead_bytes == memory.FRONT_OVERHEAD_BYTES + 4 * memory.RANK_OVERHEAD_BYTES


def _argv(*extra):
    return ["--port", str(_free_port()), "--worker-base-port", str(_free_port()), "--workers", "1", *extra]


@pytest.fixture(scope="module")
def refused_launch():
    """One ``fleetserve launch --workers 1 --max-total-tokens 4096 --dtype float32`` in a fresh
    Python process, with 1 GiB available (injected): ``(stdout, stderr)``. Its last stdout line is
    ``"<exit code> <torch imported?>"``. One process serves both tests below: each start imports
    torch in the estimate's child, the costly part of these tests."""
    script = ("import sys; from fleetserve import launch; from fleetserve.launch import memory; "
              "memory.available_memory_bytes = lambda: 1 << 30; "
              f"rc = launch.main({_argv('--max-total-tokens', '4096', '--dtype', 'float32')!r}); "
              "print(rc, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    return done.stdout, done.stderr


def test_launch_refuses_a_fleet_that_does_not_fit(refused_launch):
    out, err = refused_launch
    assert out.strip().splitlines()[-1].split()[0] == "2", (out, err)  # launch.main's exit code
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    # 538 MB weights + 4096 x 46080 B pool + 1050 MiB overhead = 1.71 GiB > 1.0 GiB
    assert lines[0].startswith("fleetserve launch: --workers 1: the fleet needs about 1.7 GiB of memory, "
                               "1.0 GiB is available"), lines[0]
    assert "--skip-memory-check" in lines[0]
    assert "[launch] memory: about 1.7 GiB per instance" in out
    assert "started" not in out  # no child was started


def test_the_launcher_itself_never_imports_torch(refused_launch):
    # the estimate runs in a child process; the launcher (alive as long as the fleet) stays small
    out, err = refused_launch
    assert out.strip().splitlines()[-1] == "2 False", (out, err)


def test_fleet_that_fits_gets_a_note():
    argv = ["--max-total-tokens", "4096", "--dtype", "float32"]
    bad, note = memory.check_fleet_memory(2, argv, available=64 * GIB)
    assert bad is None and note.startswith("memory: about 1.7 GiB per instance") and "3.4 GiB for 2" in note
    assert "(KV pool 0.2 GiB, --max-total-tokens 4096)" in note
    _, note = memory.check_fleet_memory(2, ["--dtype", "float32"], available=64 * GIB)
    assert "(KV pool 6.4 GiB, by default 10% of the available memory; --max-total-tokens or " \
        "--mem-fraction-static sets it)" in note
    _, note = memory.check_fleet_memory(1, ["--dtype", "float32", "--mem-fraction-static", "0.05"], available=64 * GIB)
    assert "(KV pool 3.2 GiB, --mem-fraction-static 0.05 of the available memory)" in note
    bad, _ = memory.check_fleet_memory(2, argv, available=3 * GIB)
    assert bad.startswith("--workers 2: the fleet needs about 3.4 GiB")


def test_sim_workers_get_no_memory_check(monkeypatch):
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 1)
    sim, rest = launch.build_parser().parse_known_args(["--worker-kind", "sim", "--workers", "64"])
    assert memory.check_launch(sim, rest) == (None, None)


def test_bad_instance_flags_are_one_line(monkeypatch):
    assert memory.check_fleet_memory(1, ["--max-total-tokens", "0"], available=64 * GIB)[0] == \
        "--max-total-tokens must be >= 1, got 0"
    assert memory.check_fleet_memory(1, ["--max-total-tokens", "0"], available=None)[0] == \
        "--max-total-tokens must be >= 1, got 0"
    assert memory.check_fleet_memory(1, ["--max-total-tokens", "4096"], available=None) == (None, None)
    # --skip-memory-check skips the estimate (the memory is not even read) but not the flag check
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: pytest.fail("memory read under --skip-memory-check"))
    args, rest = launch.build_parser().parse_known_args(["--workers", "64", "--skip-memory-check", "--tp-size", "two"])
    bad, note = memory.check_launch(args, rest)
    # one prefix: launch prints "fleetserve launch: " before it (no "fleetserve serve: error: " inside)
    assert note is None and bad == "--tp-size/--tp: invalid int value: 'two' (a fleetserve serve flag)"
    assert memory.check_fleet_memory(1, ["--max-total-tokns", "4096"], available=64 * GIB) == (
        "unrecognized fleetserve serve flags: --max-total-tokns 4096 (router flags go in --router-args \"...\")", None)
    assert memory.check_fleet_memory(1, ["--dtype", "fp8"], available=None)[0] == (
        "--dtype: invalid choice: 'fp8' (choose from 'auto', 'bfloat16', 'float16', 'float32') (a fleetserve serve flag)")


def test_available_memory_reads_meminfo():
    got = memory.available_memory_bytes()
    with open("/proc/meminfo") as f:
        total = int(next(x for x in f if x.startswith("MemTotal:")).split()[1]) * 1024
    assert got is not None and 0 < got <= total
