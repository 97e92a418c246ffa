"""The process of one rank, for every world size (one rank included).

:func:`run_rank` is the entry point :mod:`fleetserve.engine.rank_launch`
starts in each rank's process. It sets the process up (logging, SIGTERM,
parent watch), joins its replica's process group (none for a single rank),
builds the rank with :func:`~fleetserve.engine.rank_builder.build_rank`, sends
the start-up handshake and runs the scheduler loop until it is terminated.

Start-up handshake: one dict through a ``multiprocessing`` pipe once the model
is loaded and the sockets are connected (:func:`ready_message`):
``{"status": "ready", "vocab_size", "max_context_len", "eos_token_ids",
"max_total_tokens", "kv_bytes_per_token", "dp_rank", "tp_rank", "rank"}``, or
``{"status": "error", "error": "rank <r>: <type>: <message>"}`` after which the
process exits with status 1.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
from typing import Any

import torch

from fleetserve.distributed.groups import ParallelConfig, init_distributed
from fleetserve.engine.args import ServerArgs
from fleetserve.engine.parent_watch import exit_with_parent, no_leaks_on_abrupt_exit
from fleetserve.engine.rank_builder import Rank, build_rank
from fleetserve.engine.rank_io import RankEndpoints

logger = logging.getLogger(__name__)


def rank_device(args: ServerArgs, global_rank: int) -> str:
    """The device of ``global_rank``: with several ranks on CUDA, one GPU per rank of
    this node (``cuda:<global_rank mod ranks per node>``); else ``args.device``."""
    device = str(args.device)
    if args.world_size > 1 and device.startswith("cuda"):
        per_node = args.world_size // max(1, args.nnodes)
        device = f"cuda:{global_rank % per_node}"
    return device


def set_up_process(args: ServerArgs, global_rank: int, parent_pid: int | None) -> None:
    """Logging tagged ``rank[<r>]``, SIGTERM's default action, no leaked semaphores on
    an abrupt end, and an exit when ``parent_pid`` (the server) is gone."""
    logging.basicConfig(level=str(args.log_level).upper(),
                        format=f"%(asctime)s %(levelname)s rank[{global_rank}] %(name)s: %(message)s")
    # SIGTERM ends a rank at once, even inside a blocking collective (a Python handler
    # would only run after it); the watchdog treats SIGTERM as a requested stop.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    no_leaks_on_abrupt_exit()
    if parent_pid is not None:  # a rank may be a child of the fork server: it would outlive a killed server
        exit_with_parent(parent_pid)


def ready_message(rank: Rank, global_rank: int) -> dict[str, Any]:
    """The handshake dict of a rank that is ready to serve (see module docstring)."""
    s = rank.scheduler
    return {
        "status": "ready", "vocab_size": s.vocab_size, "max_context_len": s.max_context_len,
        "eos_token_ids": sorted(s.eos_ids), "max_total_tokens": s.pool_size,
        "kv_bytes_per_token": int(getattr(rank.runner, "kv_bytes_per_token", 0) or 0), "dp_rank": rank.dp_rank,
        "tp_rank": rank.pstate.tp_rank, "rank": global_rank,
    }


def start_rank(global_rank: int, args: ServerArgs, init_methods: list[str], endpoints: RankEndpoints) -> Rank:
    """Join the replica's process group (several ranks) and build the rank with its I/O.

    Raises:
        Whatever joining the group or building the rank raises.
    """
    replica, tp_rank = divmod(global_rank, int(args.tp_size))
    if args.world_size > 1:  # share this node's cores among its ranks
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, args.world_size)))
    args = dataclasses.replace(args, device=rank_device(args, global_rank))
    pstate = init_distributed(ParallelConfig.from_server_args(args), tp_rank,
                              init_methods[replica] if init_methods else "", device=args.device,
                              timeout_s=float(args.dist_timeout))
    return build_rank(args, pstate, replica=replica, endpoints=endpoints)


def run_rank(global_rank: int, args: ServerArgs, init_methods: list[str], endpoints: RankEndpoints,
             ready_writer: Any, parent_pid: int | None = None) -> None:
    """Process entry point of one rank (see module docstring).

    Args:
        global_rank: this rank's index in the instance (``replica * tp_size + tp_rank``).
        args: the instance's ServerArgs.
        init_methods: one ``tcp://`` rendezvous per replica (unused for a single rank).
        endpoints: where the ranks' sockets connect.
        ready_writer: the pipe end the handshake dict is sent on.
        parent_pid: exit when this process is gone.
    """
    set_up_process(args, global_rank, parent_pid)
    try:
        rank = start_rank(global_rank, args, init_methods, endpoints)
    except Exception as e:  # report why, then exit non-zero (the launcher stops the others)
        logger.exception("rank %d start-up failed", global_rank)
        ready_writer.send({"status": "error", "error": f"rank {global_rank}: {type(e).__name__}: {e}"})
        os._exit(1)
    ready_writer.send(ready_message(rank, global_rank))
    logger.info("rank %d (pid %d) ready: dp_rank %d, KV %d tokens x %d bytes per token on this rank", global_rank,
                os.getpid(), rank.dp_rank, rank.scheduler.pool_size,
                int(getattr(rank.runner, "kv_bytes_per_token", 0) or 0))
    try:
        rank.loop.run_forever()
    except Exception:
        logger.exception("rank %d failed", global_rank)
        os._exit(1)
