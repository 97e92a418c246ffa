"""The scheduler's DP-attention hook: one agreement per step before the forward.

Under ``--enable-dp-attention`` every attention group schedules alone but the
MoE / dense FFN spans all ranks, so before each forward the scheduler calls
this hook: it reports this rank's token count
(:func:`~fleetserve.distributed.dp_attention.sync_step`), turns "no batch
while another rank has one" into an IDLE batch, and writes the agreed counts
into the batch's :class:`~fleetserve.core.forward_batch.ForwardBatch`.
"""

from __future__ import annotations

from typing import Any

from fleetserve.distributed.dp_attention import batch_num_tokens, sync_step
from fleetserve.engine.schedule_batch import ScheduleBatch


def dp_attention_hook(pstate: Any, device: str = "cpu"):
    """The scheduler's DP-attention hook built on :func:`fleetserve.distributed.dp_attention.sync_step`."""
    def hook(sched: Any, batch: Any) -> Any:
        mode = batch.mode if batch is not None else None
        n = batch_num_tokens(mode, batch.num_tokens if batch else 0, batch.batch_size if batch else 0)
        plan = sync_step(pstate, n, batch is None or batch.mode.is_decode_or_idle())
        if plan.skip:
            return None
        if batch is None:
            batch = ScheduleBatch.idle(device)
        batch.forward_batch.global_num_tokens = plan.global_num_tokens
        batch.forward_batch.can_run_graph = plan.can_run_graph
        return batch

    return hook
