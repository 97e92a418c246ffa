"""A weight source for loading parallel linears in tests, and the column/row pair the
quantization tests shard."""

from __future__ import annotations

import torch

from fleetserve.layers.linear import ColumnParallelLinear, RowParallelLinear, TPGroup


class DictSource:
    """The ``read(name, dim, start, end)`` interface the layers' ``load`` calls, over a dict of tensors."""

    def __init__(self, **tensors):
        self.t = tensors

    def read(self, name, dim=None, start=None, end=None):
        x = self.t[name]
        return x if dim is None else x.narrow(dim, start, end - start)


def column_row_pair(src: DictSource, rank: int, size: int, mode: str | None = None):
    """A column-parallel ``up`` [in 48 -> out 64] and a row-parallel ``down`` [64 -> 48] of rank ``rank``
    of ``size``, loaded from ``src`` (tensors ``up`` and ``down``), quantized per ``--quantization mode``
    when given (asserting the mode was applied)."""
    from fleetserve.layers.quantization import apply_quantization

    col = ColumnParallelLinear(48, [64], tp=TPGroup(rank, size))
    col.load(src, "up")
    row = RowParallelLinear(64, 48, tp=TPGroup(rank, size), reduce_results=False)
    row.load(src, "down")
    if mode is not None:
        assert apply_quantization(torch.nn.ModuleList([col, row]), mode) == mode
    return col, row
