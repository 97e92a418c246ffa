"""The gated feed-forward block of Llama and DeepSeek: ``down(act(gate(x)) * up(x))``.

Gate and up projections are fused into one column-parallel matmul (one call
instead of two on the hot path); the down projection is row-parallel.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fleetserve.core import fast_path
from fleetserve.layers.linear import UNSHARDED, ColumnParallelLinear, RowParallelLinear, TPGroup


def activation(name: str):
    """The activation named in HF configs (``hidden_act``); SiLU and GELU supported."""
    if name == "silu":
        return F.silu
    if name in ("gelu", "gelu_pytorch_tanh"):
        return (lambda x: F.gelu(x, approximate="tanh")) if name.endswith("tanh") else F.gelu
    raise ValueError(f"unsupported activation {name!r}")


class GatedMLP(nn.Module):
    """SwiGLU-style MLP, intermediate dim split over ``tp``.

    Args:
        hidden_size, intermediate_size: full sizes.
        hidden_act: activation name (``silu``).
        tp: sharding group.
        reduce_results: False returns the partial sum of this rank (the caller
            all-reduces, e.g. once for shared + routed experts).

    ``forward(x [N, hidden]) -> [N, hidden]``.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu", tp: TPGroup = UNSHARDED,
                 dtype: torch.dtype = torch.float32, reduce_results: bool = True, bias: bool = False):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden_size, [intermediate_size, intermediate_size], bias=bias,
                                                 tp=tp, dtype=dtype)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, tp=tp, dtype=dtype,
                                           reduce_results=reduce_results)
        self.act = activation(hidden_act)
        self.local_inter = self.gate_up_proj.local_sizes[0]

    def load(self, source: Any, prefix: str) -> None:
        """Load ``{prefix}.gate_proj / up_proj / down_proj .weight``."""
        bias = self.gate_up_proj.bias is not None
        self.gate_up_proj.load(source, f"{prefix}.gate_proj.weight", 0, f"{prefix}.gate_proj.bias" if bias else None)
        self.gate_up_proj.load(source, f"{prefix}.up_proj.weight", 1, f"{prefix}.up_proj.bias" if bias else None)
        self.down_proj.load(source, f"{prefix}.down_proj.weight", f"{prefix}.down_proj.bias" if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        gate, up = gate_up.split(self.local_inter, dim=-1)
        if fast_path.ENABLED:
            return self.down_proj(self.act(gate).mul_(up))  # one temporary fewer, same products
        return self.down_proj(self.act(gate) * up)
