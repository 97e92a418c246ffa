"""``fleetserve launch``'s memory estimate and its refusal of a fleet that does not fit
(the available-memory figure injected, so nothing heavy starts)."""

import socket

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


def test_launch_refuses_a_fleet_that_does_not_fit(monkeypatch, capsys):
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 1 * GIB)
    code = launch.main(_argv("--max-total-tokens", "4096", "--dtype", "float32"))
    out, err = capsys.readouterr()
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    # 538 MB weights + 4096 x 46080 B pool + 1050 MiB overhead = 1.71 GiB > 1.0 GiB
    assert lines[0].startswith("fleetserve launch: --workers 1: the fleet needs about 1.7 GiB of memory, "
                               "1.0 GiB is available"), lines[0]
    assert "--skip-memory-check" in lines[0]
    assert "started" not in out  # no child was started


def test_fleet_that_fits_gets_a_note_and_skip_flag_skips(monkeypatch):
    argv = ["--workers", "2", "--max-total-tokens", "4096", "--dtype", "float32"]
    args, rest = launch.build_parser().parse_known_args(argv)
    bad, note = memory.check_fleet_memory(args, rest, available=64 * GIB)
    assert bad is None and note.startswith("memory: about 1.7 GiB per instance") and "3.4 GiB for 2" in note
    bad, _ = memory.check_fleet_memory(args, rest, available=3 * GIB)
    assert bad.startswith("--workers 2: the fleet needs about 3.4 GiB")
    args.skip_memory_check = True
    assert memory.check_fleet_memory(args, rest, available=1) == (None, None)
    sim, rest = launch.build_parser().parse_known_args(["--worker-kind", "sim", "--workers", "64"])
    assert memory.check_fleet_memory(sim, rest, available=1) == (None, None)


def test_bad_instance_flag_is_one_line():
    args, rest = launch.build_parser().parse_known_args(["--max-total-tokens", "0"])
    bad, _ = memory.check_fleet_memory(args, rest, available=64 * GIB)
    assert bad == "--max-total-tokens must be >= 1, got 0"
