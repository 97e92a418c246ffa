"""Collectives as opaque custom ops, for code that ``torch.compile`` traces (``--enable-torch-compile``).

Inside a compiled decode step the model's collectives (:func:`~fleetserve.distributed.parallel_state.all_reduce`,
:func:`~fleetserve.distributed.parallel_state.all_gather_cat`, the DP-attention token gather) call
the ops below instead of ``torch.distributed``: ``fleetserve::all_reduce`` and
``fleetserve::all_gather`` (``torch.library.custom_op``). Dynamo and inductor see each one as a single
opaque node with a known output shape, so the graph does not split around it, and at run time
the op's body runs the same gloo collective as eager code, inside :func:`comm_stats.timed` (the
counters keep counting). A process group cannot be an op argument, so the op takes a string key
(:func:`group_key`) into a process-wide table that :func:`register_groups` fills, eagerly,
before anything is compiled (a table written while dynamo traces is not written at run time).

Functional: ``all_reduce`` returns a new tensor (one copy of a decode step's ``[bs, hidden]``
activations) where eager reduces in place.

Every rank must run the same compiled step (same bucket), so the collectives pair up; the
scheduler's DP-attention agreement (``can_run_graph``, the all-reduce MIN) makes sure of it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fleetserve.distributed.comm_stats import timed

_GROUPS: dict[str, Any] = {}


def group_key(group: Any) -> str:
    """The string naming ``group`` (a ``ProcessGroup``, or None for the default group) for the ops."""
    return "default" if group is None else f"pg{id(group)}"


def register_groups(state: Any) -> int:
    """Enter every process group of ``state`` (a ParallelState: its ``*_group`` fields) in the
    ops' table; call before compiling. Returns how many groups were entered."""
    groups = [getattr(state, name) for name in vars(state) if name.endswith("group")]
    for g in groups:
        if g is not None:
            _GROUPS[group_key(g)] = g
    return sum(g is not None for g in groups)


def _group(key: str) -> Any:
    try:
        return _GROUPS[key]
    except KeyError:
        raise KeyError(f"process group {key} was not registered before compiling (register_groups)") from None


@torch.library.custom_op("fleetserve::all_reduce", mutates_args=())
def _all_reduce_op(x: torch.Tensor, group: str) -> torch.Tensor:
    y = x.clone()
    with timed("all_reduce"):
        dist.all_reduce(y, group=_group(group))
    return y


@_all_reduce_op.register_fake
def _(x: torch.Tensor, group: str) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("fleetserve::all_gather", mutates_args=())
def _all_gather_op(x: torch.Tensor, group: str, size: int, kind: str) -> torch.Tensor:
    out = x.new_empty((size, *x.shape))
    with timed(kind):
        dist.all_gather(list(out.unbind(0)), x.contiguous(), group=_group(group))
    return out


@_all_gather_op.register_fake
def _(x: torch.Tensor, group: str, size: int, kind: str) -> torch.Tensor:
    return x.new_empty((size, *x.shape))


def traced_all_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Sum of ``x`` over ``group`` (a new tensor) through ``fleetserve::all_reduce``."""
    return torch.ops.fleetserve.all_reduce(x, group_key(group))


def traced_all_gather(x: torch.Tensor, group: Any, size: int, kind: str = "all_gather") -> torch.Tensor:
    """Every rank's ``x`` stacked in rank order: ``[size, *x.shape]`` (``fleetserve::all_gather``);
    ``kind`` names the :mod:`comm_stats` counter."""
    return torch.ops.fleetserve.all_gather(x, group_key(group), int(size), kind)
