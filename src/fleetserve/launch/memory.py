"""Will the fleet fit? ``fleetserve launch``'s estimate of what its engine instances take in
host memory, checked against ``MemAvailable`` before anything starts.

Per instance (bytes)::

    FRONT_OVERHEAD + ranks * (RANK_OVERHEAD + weights / tp_size + kv_pool_per_rank)

* ``weights``: the model's parameters and buffers in the dtype it will run in, counted on a
  ``meta``-device copy of the model (no weight is read, nothing is allocated);
* ``kv_pool_per_rank``: ``--max-total-tokens * kv_bytes_per_token / attention-TP size``, or,
  when the pool is sized from memory (neither ``--max-total-tokens`` nor a CUDA device),
  the share the engine takes: ``--mem-fraction-static`` (default 0.1 on CPU,
  :data:`fleetserve.engine.model_runner.DEFAULT_CPU_KV_FRACTION`) of the available memory,
  capped at ``MAX_AUTO_TOKENS`` tokens -- the same rule as
  :class:`fleetserve.engine.model_runner.ModelRunner`. Instances start together, so each
  sees about the same available memory and takes that share.
* ``ranks``: ``ServerArgs.world_size`` (``tp_size``, or ``tp_size * dp_size`` without DP
  attention).
* the overheads: the Python, torch and tokenizer resident memory of the HTTP process and of
  one rank process besides weights and pool, measured (see the constants).

Only CPU instances are checked (on CUDA the weights and the pool live in device memory).
``fleetserve launch`` calls :func:`check_launch`, which runs :func:`check_fleet_memory` in a
child process (``python -m fleetserve.launch.memory``) so that the launcher never imports torch.
The same child checks the engine instances' flags (``fleetserve serve``'s parser and
``ServerArgs``), with ``--skip-memory-check`` too; sim workers' flags are checked in the launcher
itself (:func:`check_sim_flags`: ``sim-worker``'s parser and checks, which import no torch).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

# launch hands unknown flags to the instances; a router flag given there lands in this message (a user
# trial gave --kv-backlog-discount to launch itself)
ROUTER_HINT = " (router flags go in --router-args \"...\")"

MIB = 1 << 20
GIB = 1 << 30

#: Resident memory of ``fleetserve serve``'s HTTP process (FastAPI, tokenizer, the engine's
#: client side) plus multiprocessing's resource tracker. Measured on the built-in SmolLM2
#: at default flags on the 2-core, 24 GiB CPU build machine (Dec 2026): 337 MB + 13 MB RSS
#: after four 1,500-token chat requests.
FRONT_OVERHEAD_BYTES = 350 * MIB
#: Resident memory of one rank process besides its weights and KV pool (interpreter, torch,
#: activations, the radix tree), same measurement: 3,558 MB RSS - 538 MB weights - 2,344 MB
#: KV pool = 676 MB; with ``--max-total-tokens 4096``: 1,415 - 538 - 189 = 688 MB. Rounded up.
RANK_OVERHEAD_BYTES = 700 * MIB


@dataclass(frozen=True)
class InstanceEstimate:
    """What one instance is expected to hold in host memory. Sizes in bytes."""

    weights_bytes: int
    kv_pool_bytes: int  # all ranks together
    overhead_bytes: int
    ranks: int

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_pool_bytes + self.overhead_bytes


def available_memory_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (the figure the engine sizes its KV pool
    from), or None where it cannot be read. Standard library only."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def model_sizes(model_path: str | None, dtype: str) -> tuple[int, int]:
    """``(weight bytes, KV bytes per token)`` of the whole model (one rank, no parallelism)
    in ``dtype`` (``"auto"`` resolved as the engine resolves it), from a ``meta`` copy.

    Raises whatever loading the model's config raises (FileNotFoundError, ValueError).
    """
    import torch

    from fleetserve.distributed.parallel_state import SINGLE_RANK_STATE
    from fleetserve.models.config import architecture, load_model_config, resolve_dtype
    from fleetserve.models.registry import default_model_path, model_class

    config = load_model_config(model_path or default_model_path())
    dt = resolve_dtype(dtype)
    with torch.device("meta"):
        model = model_class(architecture(config))(config, pstate=SINGLE_RANK_STATE, dtype=dt)
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors), int(model.kv_bytes_per_token(dt))


def estimate_instance(server_args, available: int, weights_bytes: int, kv_bytes_per_token: int) -> InstanceEstimate:
    """The estimate of the module docstring for one instance started with ``server_args``
    (a :class:`fleetserve.engine.args.ServerArgs`) on a machine with ``available`` bytes free."""
    from fleetserve.engine.model_runner import DEFAULT_CPU_KV_FRACTION, MAX_AUTO_TOKENS

    ranks = server_args.world_size
    per_rank_kv_token = kv_bytes_per_token // max(1, server_args.attn_tp_size)
    if server_args.max_total_tokens is not None:
        kv_rank = server_args.max_total_tokens * per_rank_kv_token
    else:
        frac = server_args.mem_fraction_static or DEFAULT_CPU_KV_FRACTION
        kv_rank = min(int(available * frac), MAX_AUTO_TOKENS * per_rank_kv_token)
    return InstanceEstimate(weights_bytes=weights_bytes // max(1, server_args.tp_size) * ranks,
                            kv_pool_bytes=kv_rank * ranks,
                            overhead_bytes=FRONT_OVERHEAD_BYTES + ranks * RANK_OVERHEAD_BYTES, ranks=ranks)


def kv_pool_source(server_args) -> str:
    """Where the KV pool size of the estimate comes from, for the launch note: the flag the user
    gave, or the default fraction of the memory available and the flags that change it."""
    from fleetserve.engine.model_runner import DEFAULT_CPU_KV_FRACTION

    if server_args.max_total_tokens is not None:
        return f"--max-total-tokens {server_args.max_total_tokens}"
    if server_args.mem_fraction_static:
        return f"--mem-fraction-static {server_args.mem_fraction_static:g} of the available memory"
    return (f"by default {DEFAULT_CPU_KV_FRACTION:.0%} of the available memory; "
            "--max-total-tokens or --mem-fraction-static sets it")


def fleet_memory_error(workers: int, est: InstanceEstimate, available: int) -> str | None:
    """One line saying the fleet does not fit (naming the flags that change it), or None."""
    need = workers * est.total_bytes
    if need <= available:
        return None
    return (f"--workers {workers}: the fleet needs about {need / GIB:.1f} GiB of memory, {available / GIB:.1f} GiB "
            f"is available (per instance: weights {est.weights_bytes / GIB:.2f} GiB + KV pool "
            f"{est.kv_pool_bytes / GIB:.2f} GiB + overhead {est.overhead_bytes / GIB:.2f} GiB); use fewer --workers, "
            f"a smaller --max-total-tokens, or --skip-memory-check")


def check_fleet_memory(workers: int, instance_args: list[str], available: int | None) -> tuple[str | None, str | None]:
    """``(error, note)`` for ``workers`` engine instances started with ``instance_args`` on a
    machine with ``available`` bytes free (None: the flags only, ``(error, None)``). Imports torch
    (the engine's flags and the model).

    ``error``: one line when the fleet would not fit, or when the instance flags (an unknown one
    too) or the model's config are bad (the instances would fail anyway); ``note``: one line with the estimate, or
    why none was made (non-CPU devices are not checked).
    """
    import argparse

    from fleetserve.engine.args import ServerArgs
    from fleetserve.entrypoints.serve import build_parser

    try:
        ns, unknown = build_parser(exit_on_error=False).parse_known_args(instance_args)
    except argparse.ArgumentError as e:  # argparse's words after the flag's name; launch prints its own prefix
        return f"{e.argument_name or 'fleetserve serve flags'}: {e.message} (a fleetserve serve flag)", None
    if unknown:  # a typo every instance would refuse after its start
        return f"unrecognized fleetserve serve flags: {' '.join(unknown)}{ROUTER_HINT}", None
    try:
        server_args = ServerArgs.from_cli_args(ns)
    except ValueError as e:
        return str(e), None
    if available is None:
        return None, None
    if server_args.device != "cpu":
        return None, f"memory check: not made for --device {server_args.device}"
    try:
        weights, kv_per_token = model_sizes(server_args.model_path, server_args.dtype)
    except (FileNotFoundError, ValueError) as e:
        return f"--model-path {server_args.model_path or '(built-in)'}: {e}", None
    except Exception as e:  # a model that cannot be built on the meta device: do not guess
        return None, f"memory check: skipped, the model's size is unknown ({type(e).__name__}: {e})"
    est = estimate_instance(server_args, available, weights, kv_per_token)
    bad = fleet_memory_error(workers, est, available)
    note = (f"memory: about {est.total_bytes / GIB:.1f} GiB per instance (KV pool {est.kv_pool_bytes / GIB:.1f} GiB, "
            f"{kv_pool_source(server_args)}), {workers * est.total_bytes / GIB:.1f} GiB for {workers}; "
            f"{available / GIB:.1f} GiB available")
    return bad, note


def check_sim_flags(instance_args: list[str]) -> str | None:
    """One line for the first bad ``sim-worker`` flag in ``instance_args`` (an unknown one too), else None.

    In this process: the flags' module (:mod:`fleetserve.bench.sim_args`) imports no torch.
    """
    import argparse

    from fleetserve.bench import sim_args

    try:
        ns, unknown = sim_args.build_parser(exit_on_error=False).parse_known_args(instance_args)
    except argparse.ArgumentError as e:  # argparse's words after the flag's name; launch prints its own prefix
        return f"{e.argument_name or 'sim-worker flags'}: {e.message} (a sim-worker flag)"
    if unknown:
        return f"unrecognized sim-worker flags: {' '.join(unknown)}{ROUTER_HINT}"
    return sim_args.check_args(ns)


def check_launch(args: argparse.Namespace, instance_args: list[str],
                 timeout: float = 300.0) -> tuple[str | None, str | None]:
    """``fleetserve launch``'s check of its instances (``args``: its namespace): their flags for
    every ``--worker-kind``, and for engines :func:`check_fleet_memory` unless
    ``--skip-memory-check``. For engines it runs in a short-lived ``python -m
    fleetserve.launch.memory`` so that the launcher itself never imports torch (it stays a few
    tens of MB for the life of the fleet); sim flags are checked here (:func:`check_sim_flags`).
    A note, no error, if the check itself fails. ``available`` comes from
    :func:`available_memory_bytes` here."""
    import json
    import subprocess
    import sys

    if args.worker_kind == "sim":
        return check_sim_flags(instance_args), None
    note = None
    available = None
    if not args.skip_memory_check:
        available = available_memory_bytes()
        if available is None:
            note = "memory check: not made, MemAvailable unreadable"
    cmd = [sys.executable, "-m", "fleetserve.launch.memory", str(args.workers),
           "-" if available is None else str(available), *instance_args]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return None, f"instance check: skipped, no answer within {timeout:g} s"
    lines = done.stdout.strip().splitlines()
    if done.returncode == 0 and lines:
        out = json.loads(lines[-1])
        return out["error"], out["note"] or note
    err = done.stderr.strip().splitlines()
    if done.returncode == 2 and err:  # argparse refused an instance flag: the instances would too
        return err[-1].removeprefix("fleetserve serve: error: "), None
    return None, f"instance check: skipped (exit {done.returncode}: {err[-1] if err else 'no output'})"


def main(argv: list[str]) -> int:
    """``python -m fleetserve.launch.memory WORKERS AVAILABLE_BYTES|- [instance flags...]``: print
    ``{"error": ..., "note": ...}`` (one JSON line) of :func:`check_fleet_memory` (``-``: the flags only)."""
    import json

    workers, available, flags = int(argv[0]), argv[1], argv[2:]
    error, note = check_fleet_memory(workers, flags, None if available == "-" else int(available))
    print(json.dumps({"error": error, "note": note}), flush=True)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
