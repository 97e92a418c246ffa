"""How an instance starts its rank processes (:func:`launch_ranks`).

Every rank runs :func:`fleetserve.engine.rank_process.run_rank`, whatever the
world size:

* one rank: its process (``spawn``) connects straight to the tokenizer
  manager's sockets; the HTTP side watches it through ``is_alive``;
* several ranks: the sizes are checked against the model, every rank of this
  node starts through :class:`~fleetserve.engine.rank_supervisor.RankSupervisor`
  (``forkserver``, torch preloaded), node 0 runs a
  :class:`~fleetserve.engine.dp_relay.DPRelay` thread in the calling
  (HTTP) process that assigns each request to one DP rank, and a watchdog
  thread stops the other ranks and exits the calling process with status 1
  (after logging which rank died) when any rank exits.

All ranks share one sampling seed, so that the ranks of a TP group sample alike.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import multiprocessing as mp
import os
import random
import shutil
import tempfile
import time
import zlib
from typing import Any

from fleetserve.distributed.groups import ModelShape, ParallelConfig, ParallelConfigError, validate
from fleetserve.engine.args import ServerArgs
from fleetserve.engine.dp_controller import DPController
from fleetserve.engine.dp_relay import DPRelay
from fleetserve.engine.rank_io import RankEndpoints
from fleetserve.engine.rank_process import run_rank
from fleetserve.engine.rank_supervisor import RankSupervisor, exit_instance, replica_init_methods
from fleetserve.models.config import load_model_config

logger = logging.getLogger(__name__)


class RankInstance:
    """What :func:`launch_ranks` started (processes, relay, supervisor)."""

    def __init__(self, launcher: RankSupervisor, relay: DPRelay | None, readers: list[Any], ipc_dir: str | None):
        self.launcher = launcher
        self.relay = relay
        self.readers = readers
        self.ipc_dir = ipc_dir

    @property
    def procs(self) -> list[Any]:
        return list(self.launcher.procs.values())

    def stop(self) -> None:
        self.launcher.stop()
        if self.relay is not None:
            self.relay.stop()


def relay_endpoints(args: ServerArgs, ipc_dir: str) -> tuple[list[str], str]:
    """Where the relay's per-DP-rank PUSH sockets and its output PULL live.

    One node: ``ipc://`` files in ``ipc_dir``. Several nodes: TCP on the host of
    ``--dist-init-addr`` (node 0), ports ``port + 1 .. port + dp_size`` for the ranks'
    inputs and ``port + dp_size + 1`` for their outputs (``port`` itself is the
    process-group rendezvous).
    """
    if args.nnodes == 1:
        return [f"ipc://{ipc_dir}/rank{d}_in" for d in range(args.dp_size)], f"ipc://{ipc_dir}/ranks_out"
    host, _, port = str(args.dist_init_addr).rpartition(":")
    base = int(port)
    return ([f"tcp://{host}:{base + 1 + d}" for d in range(args.dp_size)], f"tcp://{host}:{base + 1 + args.dp_size}")


def validate_for_model(args: ServerArgs) -> None:
    """Refuse impossible sizes for ``args.model_path`` (raises ParallelConfigError)."""
    cfg = ParallelConfig.from_server_args(args)
    validate(cfg)
    if args.model_path is not None:
        validate(cfg, ModelShape.from_hf_config(load_model_config(args.model_path)))


def launch_ranks(args: ServerArgs, input_endpoint: str, output_endpoint: str, watchdog: bool = True,
                 on_failure: Any = None) -> RankInstance:
    """Start every rank of this node (see module docstring).

    Args:
        args: the instance's ServerArgs.
        input_endpoint / output_endpoint: the tokenizer manager's bound PUSH / PULL.
        watchdog: several ranks: stop everything when a rank dies and call
            ``on_failure(err)`` (default: log and exit this process with status 1).

    Returns:
        A :class:`RankInstance`; its ``readers`` yield each rank's handshake dict
        (:mod:`fleetserve.engine.rank_process`).

    With ``--nnodes N`` this node starts its ``world_size / N`` ranks; node 0 also
    runs the relay, whose sockets are then TCP ports next to ``--dist-init-addr``
    (:func:`relay_endpoints`) so that the other nodes' ranks can reach it.

    Raises:
        RuntimeError: impossible sizes for this model. NotImplementedError: DP replicas
        (no DP attention) over several nodes.
    """
    if args.world_size == 1:
        return _launch_single(args, RankEndpoints((input_endpoint,), output_endpoint))
    try:
        validate_for_model(args)
    except ParallelConfigError as e:  # the server reports RuntimeErrors as one clean line
        raise RuntimeError(f"impossible parallel layout: {e}") from e
    num_replicas = 1 if args.enable_dp_attention else args.dp_size
    if args.nnodes > 1 and num_replicas > 1:
        raise NotImplementedError("several nodes run one process group: use --enable-dp-attention (or --dp-size 1); "
                                  "independent DP replicas across nodes are separate instances behind the router")
    if args.random_seed is None:  # one seed for all ranks (on every node), so TP ranks sample alike
        seed = zlib.crc32(str(args.dist_init_addr).encode()) if args.nnodes > 1 else random.randrange(1 << 31)
        args = dataclasses.replace(args, random_seed=seed)
    init_methods = replica_init_methods(num_replicas, args.dist_init_addr)
    ipc_dir = tempfile.mkdtemp(prefix="fleetserve-ranks-")
    atexit.register(shutil.rmtree, ipc_dir, True)
    rank_eps, out_ep = relay_endpoints(args, ipc_dir)
    relay = None
    if args.node_rank == 0:
        relay = DPRelay(DPController(args.dp_size, args.load_balance_method), input_endpoint, output_endpoint,
                        rank_eps, out_ep).start()
    per_node = args.world_size // args.nnodes
    mine = list(range(args.node_rank * per_node, (args.node_rank + 1) * per_node))
    endpoints = RankEndpoints(tuple(rank_eps), out_ep)
    ctx = mp.get_context("forkserver")
    pipes = {r: ctx.Pipe(duplex=False) for r in mine}
    launcher = RankSupervisor(run_rank, mine,
                              args_for_rank=lambda r: (args, init_methods, endpoints, pipes[r][1], os.getpid()),
                              preload=("torch",), name="fleetserve-rank")
    launcher.start()
    for _, w in pipes.values():
        w.close()
    if watchdog:
        launcher.start_watchdog(on_failure or exit_instance)
    return RankInstance(launcher, relay, [pipes[r][0] for r in mine], ipc_dir)


def _launch_single(args: ServerArgs, endpoints: RankEndpoints) -> RankInstance:
    """The one rank of a single-rank instance, connected to the tokenizer manager directly."""
    reader, writer = mp.get_context("spawn").Pipe(duplex=False)
    launcher = RankSupervisor(run_rank, [0], args_for_rank=lambda r: (args, [], endpoints, writer, os.getpid()),
                              start_method="spawn", preload=(), name="fleetserve-scheduler")
    launcher.start()
    writer.close()
    return RankInstance(launcher, None, [reader], None)


def run_worker_node(args: ServerArgs, startup_timeout: float = 600.0) -> int:
    """``fleetserve serve --node-rank K`` (K > 0): start this node's ranks, no HTTP server.

    Blocks while the ranks run; returns 1 (after logging why) if one fails to start.
    A rank dying later ends this process through the watchdog (status 1).
    """
    instance = launch_ranks(args, "", "")
    deadline = time.monotonic() + startup_timeout
    for reader in instance.readers:
        while not reader.poll(0.5):
            if time.monotonic() > deadline:
                logger.error("ranks of node %d not ready after %.0f s", args.node_rank, startup_timeout)
                instance.stop()
                return 1
        msg = reader.recv()
        if msg.get("status") != "ready":
            logger.error("%s", msg.get("error"))
            instance.stop()
            return 1
    logger.info("node %d: ranks %s ready", args.node_rank, sorted(instance.launcher.procs))
    while True:
        time.sleep(1.0)
