"""The scheduler's DP-attention hook: one agreement per step before the forward.

Under ``--enable-dp-attention`` every attention group schedules alone but the
MoE / dense FFN spans all ranks, so before each forward the scheduler calls
this hook: it reports this rank's token count
(:func:`~fleetserve.distributed.dp_attention.sync_step`), turns "no batch
while another rank has one" into an IDLE batch, and writes the agreed counts
into the batch's :class:`~fleetserve.core.forward_batch.ForwardBatch`.

The all-reduce(MIN) that decides whether the step may replay a decode graph
runs only when the model runner has decode graphs
(``ModelRunner.decode_graphs_enabled``), as SGLang guards it with
``disable_cuda_graph``; otherwise ``can_run_graph`` stays False and the step
costs one collective (the count all-gather). Every rank of an instance is
built from the same arguments, so all of them make the same choice.
"""

from __future__ import annotations

from typing import Any

from fleetserve.distributed.dp_attention import batch_num_tokens, sync_step
from fleetserve.engine.schedule_batch import ScheduleBatch


def dp_attention_hook(pstate: Any, device: str = "cpu", check_graph: bool | None = None):
    """The scheduler's DP-attention hook built on :func:`fleetserve.distributed.dp_attention.sync_step`.

    Args:
        pstate: this rank's :class:`~fleetserve.distributed.parallel_state.ParallelState`.
        device: where an IDLE batch's (empty) tensors live.
        check_graph: run the graph-eligibility all-reduce(MIN); ``None`` (default) asks
            the scheduler's runner (``decode_graphs_enabled``, False when it has none).

    Returns:
        ``hook(scheduler, batch_or_None) -> batch_or_None`` (None: no rank steps).
    """
    def hook(sched: Any, batch: Any) -> Any:
        check = check_graph
        if check is None:
            check = bool(getattr(sched.runner, "decode_graphs_enabled", False))
        mode = batch.mode if batch is not None else None
        n = batch_num_tokens(mode, batch.num_tokens if batch else 0, batch.batch_size if batch else 0)
        plan = sync_step(pstate, n, batch is None or batch.mode.is_decode_or_idle(), check_graph=check)
        if plan.skip:
            return None
        if batch is None:
            batch = ScheduleBatch.idle(device)
        batch.forward_batch.global_num_tokens = plan.global_num_tokens
        batch.forward_batch.can_run_graph = plan.can_run_graph
        return batch

    return hook
