"""One rank's pieces, built one way for every world size.

:func:`build_rank` is the single start-up sequence of a rank once its parallel
layout is known: the DP-attention scheduling rule, the model runner (the rank's
model shard and KV pool), the DP-attention hook, the scheduler and, for a rank
that runs as its own process, its ZMQ I/O and event loop. The rank process
(:mod:`fleetserve.engine.rank_process`, any world size, one rank included), the
in-process test harness (:mod:`fleetserve.testing.rank_engine`) and the offline
:class:`fleetserve.Engine` all call it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch

from fleetserve.distributed.dp_attention import dp_schedule_rule
from fleetserve.distributed.parallel_state import ParallelState
from fleetserve.engine.args import ServerArgs
from fleetserve.engine.dp_attention_hook import dp_attention_hook
from fleetserve.engine.kv_events.config import parse_kv_events_config
from fleetserve.engine.kv_events.publisher import make_publisher
from fleetserve.engine.model_runner import ModelRunner
from fleetserve.engine.rank_io import RankEndpoints, connect_rank_io
from fleetserve.engine.scheduler import Scheduler
from fleetserve.engine.scheduler_loop import SchedulerLoop

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Rank:
    """What :func:`build_rank` made.

    Attributes:
        args: the rank's ServerArgs (after the DP-attention scheduling rule).
        pstate: the rank's :class:`ParallelState`.
        runner: its :class:`ModelRunner` (or the runner it was given).
        scheduler: its :class:`Scheduler`.
        dp_hook: the DP-attention hook, ``None`` without DP attention.
        dp_rank: which DP rank this is (attention group, or replica).
        leader: this rank reads requests for its attention group.
        loop: its :class:`SchedulerLoop` when built with endpoints, else ``None``.
    """

    args: ServerArgs
    pstate: ParallelState
    runner: Any
    scheduler: Scheduler
    dp_hook: Callable[..., Any] | None
    dp_rank: int
    leader: bool
    loop: SchedulerLoop | None = None


def make_model_runner(args: ServerArgs, pstate: ParallelState, show_progress: bool = False) -> ModelRunner:
    """The :class:`ModelRunner` that ``args`` describes, for the rank at ``pstate``.

    Sets torch's thread count first when ``--torch-num-threads`` is given."""
    if args.torch_num_threads:
        torch.set_num_threads(int(args.torch_num_threads))
        logger.info("--torch-num-threads %d", args.torch_num_threads)
    return ModelRunner(model_path=args.model_path, dtype=args.dtype, max_total_tokens=args.max_total_tokens,
                       mem_fraction_static=args.mem_fraction_static, pstate=pstate, device=args.device,
                       show_progress=show_progress, disable_cuda_graph=args.disable_cuda_graph,
                       cuda_graph_max_bs=args.cuda_graph_max_bs, page_size=args.page_size,
                       quantization=args.quantization, enable_torch_compile=args.enable_torch_compile,
                       torch_compile_max_bs=args.torch_compile_max_bs,
                       torch_compile_region=args.torch_compile_region)


def build_rank(args: ServerArgs, pstate: ParallelState, *, replica: int = 0, runner: Any = None,
               endpoints: RankEndpoints | None = None) -> Rank:
    """Build one rank: scheduling rule, model runner, DP-attention hook, scheduler, I/O.

    Args:
        args: the instance's ServerArgs (``device`` already this rank's device).
        pstate: the rank's layout (``SINGLE_RANK_STATE`` for one rank).
        replica: this rank's replica index (its DP rank without DP attention).
        runner: use this model runner instead of loading one.
        endpoints: connect the rank's sockets there (its DP rank's input) and build its
            loop (process paths).

    Returns:
        A :class:`Rank`.

    Raises:
        Whatever loading the model raises (``FileNotFoundError``, ``ValueError`` ...);
        ``zmq.ZMQError`` for endpoints zmq cannot connect to; ``ValueError``
        (``--kv-events-config: endpoint ...``) when the KV-event socket cannot be opened.
    """
    cons, chunk = dp_schedule_rule(args.schedule_conservativeness, args.chunked_prefill_size, pstate.attn_dp_size)
    args = dataclasses.replace(args, schedule_conservativeness=cons, chunked_prefill_size=chunk)
    dp_rank = pstate.attn_dp_rank if pstate.attn_dp_size > 1 else replica
    leader = pstate.attn_tp_rank == 0
    # KV events: one publisher per DP rank, on its attention group's leader (the group's
    # ranks hold identical caches); opened before the model loads so a busy port fails fast.
    events = make_publisher(parse_kv_events_config(args.kv_events_config), dp_rank) if leader else None
    try:
        if runner is None:
            runner = make_model_runner(args, pstate)
        hook = dp_attention_hook(pstate, args.device) if pstate.attn_dp_size > 1 else None
        scheduler = Scheduler(args, runner, dp_hook=hook, event_sink=events)
    except BaseException:
        if events is not None:
            events.shutdown()
        raise
    rank = Rank(args, pstate, runner, scheduler, hook, dp_rank, leader)
    if endpoints is not None:
        recv, send = connect_rank_io(endpoints, dp_rank, leader)
        rank.loop = SchedulerLoop(scheduler, recv, send, dp_rank=dp_rank, always_step=hook is not None,
                                  pstate=pstate, leader=leader)
    return rank
