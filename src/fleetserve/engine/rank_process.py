"""One scheduler + model runner process per rank, and how an instance starts them.

:func:`launch_rank_schedulers` is what ``fleetserve serve`` calls for more than
one rank. It validates the sizes against the model, then starts

* one process per rank (:func:`run_rank`, through :class:`RankSupervisor`): it
  joins its replica's process group, builds its :class:`ParallelState`, loads
  its model shard and KV pool, and runs the scheduler loop;
* a :class:`~fleetserve.engine.dp_controller.DPRelay` thread in the calling
  (HTTP) process, which assigns each request to one DP rank;
* a watchdog thread: when any rank exits, the other ranks are stopped and
  the calling process exits with status 1 after logging which rank died.

Inside one attention group (``attn_tp_size`` ranks, i.e. plain TP), only the
group's first rank talks to the relay; it broadcasts what it received to the
others over the group's gloo CPU group every loop iteration (at least every
``HEARTBEAT_S`` seconds while idle, so the broadcast never reaches the
collective timeout), and only it sends generated tokens (every rank answers
stats and flush requests, one answer per process as the HTTP side expects). All ranks of a group step in
lockstep on identical inputs; they share one sampling seed so that sampled
tokens agree.

Under DP attention each attention group also uses the scheduling rule of
:func:`fleetserve.distributed.dp_attention.dp_schedule_rule`.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import random
import shutil
import signal
import tempfile
import zlib
from typing import Any

logger = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
MAX_IDLE_POLL_MS = 20


def _loop_class():
    import torch.distributed as dist
    import zmq

    from fleetserve.engine.io_struct import BatchTokenOut
    from fleetserve.engine.scheduler_process import IDLE_POLL_MS, SchedulerLoop

    class RankSchedulerLoop(SchedulerLoop):
        """:class:`SchedulerLoop` whose attention group's first rank receives for all."""

        def __init__(self, *a: Any, pstate: Any, leader: bool, **kw: Any):
            super().__init__(*a, **kw)
            self.pstate = pstate
            self.leader = leader
            self.src = pstate.attn_dp_rank * pstate.attn_tp_size  # the group's first rank
            self.idle_ms = IDLE_POLL_MS
            self.last_forward_ct = None

        def _idle_wait_ms(self) -> int:
            """How long an idle leader waits for a message before stepping anyway.

            Under DP attention every iteration joins the per-step collectives. While
            another rank is busy (the last step ran a forward, IDLE here) this rank
            does not wait at all, so it never slows the others' steps; while every
            rank is idle it backs off from 2 ms to ``MAX_IDLE_POLL_MS`` (an idle
            instance then costs ~50 small all-gathers a second, and a request arriving
            at an idle instance waits at most that long for the other ranks). Plain TP
            waits up to ``HEARTBEAT_S`` (the broadcast keeps the group in step).
            """
            if not self.always_step:
                return int(HEARTBEAT_S * 1000)
            ct = getattr(self.scheduler, "forward_ct", None)
            ran_forward, self.last_forward_ct = ct != self.last_forward_ct, ct
            if ran_forward:  # another rank is busy (this one ran IDLE): keep pace, no wait
                self.idle_ms = IDLE_POLL_MS
                return 0
            wait = self.idle_ms
            self.idle_ms = min(MAX_IDLE_POLL_MS, self.idle_ms * 2)
            return wait

        def recv_requests(self, block: bool) -> list[Any]:
            msgs: list[Any] = []
            if self.leader:
                if block:
                    self.poller.poll(self._idle_wait_ms())
                else:
                    self.idle_ms = IDLE_POLL_MS
                msgs = super().recv_requests(block=False)
            if self.pstate.attn_tp_size == 1:
                return msgs
            box = [msgs]
            dist.broadcast_object_list(box, src=self.src, group=self.pstate.attn_tp_cpu_group)
            return box[0]

        def _send(self, obj: Any) -> None:
            # Every rank answers stats and flush requests (the HTTP side counts one answer
            # per process); generated tokens come from the group's first rank only.
            if self.leader or not isinstance(obj, BatchTokenOut):
                super()._send(obj)

    return RankSchedulerLoop, zmq


def _exit_with_parent(parent_pid: int, every_s: float = 1.0) -> None:
    """End this rank when the process that launched the instance is gone (a rank is a
    child of the fork server, so it would otherwise outlive a killed server)."""
    from fleetserve.engine.parent_watch import exit_with_parent

    exit_with_parent(parent_pid, every_s)


def run_rank(global_rank: int, args: Any, init_methods: list[str], rank_endpoints: list[str],
             outputs_endpoint: str, ready_writer: Any, parent_pid: int | None = None) -> None:
    """Process entry point of one rank (see module docstring)."""
    from fleetserve.distributed.dp_attention import dp_schedule_rule
    from fleetserve.distributed.groups import ParallelConfig, init_distributed

    tp_size = int(args.tp_size)
    replica, tp_rank = divmod(global_rank, tp_size)
    logging.basicConfig(level=str(args.log_level).upper(),
                        format=f"%(asctime)s %(levelname)s rank[{global_rank}] %(name)s: %(message)s")
    # SIGTERM ends a rank at once, even inside a blocking collective (a Python handler
    # would only run after it); the watchdog treats SIGTERM as a requested stop.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    from fleetserve.engine.parent_watch import no_leaks_on_abrupt_exit

    no_leaks_on_abrupt_exit()
    if parent_pid is not None:
        _exit_with_parent(parent_pid)
    try:
        import torch

        from fleetserve.engine.scheduler import Scheduler
        from fleetserve.engine.dp_attention_hook import dp_attention_hook
        from fleetserve.engine.scheduler_process import _make_runner

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, args.world_size)))
        cfg = ParallelConfig.from_server_args(args)
        device = str(args.device)
        if device.startswith("cuda"):
            per_node = args.world_size // max(1, args.nnodes)
            device = f"cuda:{global_rank % per_node}"
        ps = init_distributed(cfg, tp_rank, init_methods[replica], device=device,
                              timeout_s=float(args.dist_timeout))
        cons, chunk = dp_schedule_rule(args.schedule_conservativeness, args.chunked_prefill_size, ps.attn_dp_size)
        args = dataclasses.replace(args, schedule_conservativeness=cons, chunked_prefill_size=chunk, device=device)
        runner = _make_runner(args, ps)
        hook = dp_attention_hook(ps, device) if ps.attn_dp_size > 1 else None
        scheduler = Scheduler(args, runner, dp_hook=hook)
        dp_rank = ps.attn_dp_rank if ps.attn_dp_size > 1 else replica
        leader = ps.attn_tp_rank == 0
        loop_cls, zmq = _loop_class()
        ctx = zmq.Context()
        recv = ctx.socket(zmq.PULL)
        send = ctx.socket(zmq.PUSH)
        send.setsockopt(zmq.LINGER, 0)
        send.connect(outputs_endpoint)
        if leader:
            recv.connect(rank_endpoints[dp_rank])
    except Exception as e:  # report why, then exit non-zero (the launcher stops the others)
        logger.exception("rank %d start-up failed", global_rank)
        ready_writer.send({"status": "error", "error": f"rank {global_rank}: {type(e).__name__}: {e}"})
        os._exit(1)
    ready_writer.send({
        "status": "ready", "vocab_size": scheduler.vocab_size, "max_context_len": scheduler.max_context_len,
        "eos_token_ids": sorted(scheduler.eos_ids), "max_total_tokens": scheduler.pool_size,
        "kv_bytes_per_token": int(getattr(runner, "kv_bytes_per_token", 0) or 0), "dp_rank": dp_rank,
        "tp_rank": tp_rank, "rank": global_rank,
    })
    logger.info("rank %d (pid %d) ready: dp_rank %d, KV %d tokens x %d bytes per token on this rank", global_rank,
                os.getpid(), dp_rank,
                scheduler.pool_size, int(getattr(runner, "kv_bytes_per_token", 0) or 0))
    loop = loop_cls(scheduler, recv, send, dp_rank=dp_rank, always_step=hook is not None, pstate=ps, leader=leader)
    try:
        loop.run_forever()
    except Exception:
        logger.exception("rank %d failed", global_rank)
        os._exit(1)


class RankInstance:
    """What :func:`launch_rank_schedulers` started (processes, relay, launcher)."""

    def __init__(self, launcher: Any, relay: Any, readers: list[Any], ipc_dir: str):
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


def relay_endpoints(args: Any, ipc_dir: str) -> tuple[list[str], str]:
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


def run_worker_node(args: Any, startup_timeout: float = 600.0) -> int:
    """``fleetserve serve --node-rank K`` (K > 0): start this node's ranks, no HTTP server.

    Blocks while the ranks run; returns 1 (after logging why) if one fails to start.
    A rank dying later ends this process through the watchdog (status 1).
    """
    import time

    instance = launch_rank_schedulers(args, "", "")
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


def validate_for_model(args: Any) -> None:
    """Refuse impossible sizes for ``args.model_path`` (raises ParallelConfigError)."""
    from fleetserve.distributed.groups import ModelShape, ParallelConfig, validate
    from fleetserve.models.config import load_model_config

    cfg = ParallelConfig.from_server_args(args)
    validate(cfg)
    if args.model_path is not None:
        validate(cfg, ModelShape.from_hf_config(load_model_config(args.model_path)))


def launch_rank_schedulers(args: Any, input_endpoint: str, output_endpoint: str, watchdog: bool = True,
                           on_failure: Any = None) -> RankInstance:
    """Start every rank of this node plus the DP relay (see module docstring).

    Args:
        args: ``ServerArgs`` with ``world_size > 1``.
        input_endpoint / output_endpoint: the tokenizer manager's bound PUSH / PULL.
        watchdog: stop everything when a rank dies and call ``on_failure(err)``
            (default: log and exit this process with status 1).

    Returns:
        A :class:`RankInstance`; its ``readers`` yield each rank's ready dict.

    With ``--nnodes N`` this node starts its ``world_size / N`` ranks; node 0 also
    runs the relay, whose sockets are then TCP ports next to ``--dist-init-addr``
    (:func:`relay_endpoints`) so that the other nodes' ranks can reach it.

    Raises:
        RuntimeError: impossible sizes for this model. NotImplementedError: DP replicas
        (no DP attention) over several nodes.
    """
    import multiprocessing as mp

    from fleetserve.engine.rank_supervisor import RankSupervisor, exit_instance, replica_init_methods
    from fleetserve.engine.dp_controller import DPController, DPRelay

    from fleetserve.distributed.groups import ParallelConfigError

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
    ctx = mp.get_context("forkserver")
    pipes = {r: ctx.Pipe(duplex=False) for r in mine}
    launcher = RankSupervisor(run_rank, mine,
                            args_for_rank=lambda r: (args, init_methods, rank_eps, out_ep, pipes[r][1],
                                                     os.getpid()),
                            preload=("torch",), name="fleetserve-rank")
    launcher.start()
    for _, w in pipes.values():
        w.close()
    if watchdog:
        launcher.start_watchdog(on_failure or exit_instance)
    return RankInstance(launcher, relay, [pipes[r][0] for r in mine], ipc_dir)
