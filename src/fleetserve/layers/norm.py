"""RMSNorm (Zhang & Sennrich 2019), computed the way the Llama / DeepSeek
reference implementations do: statistics in float32, the weight applied after
casting back to the input dtype (so fp32 logits match transformers bit for bit
up to summation order).
"""

from __future__ import annotations

import torch
from torch import nn

from fleetserve.core import fast_path


class RMSNorm(nn.Module):
    """``y = weight * x / sqrt(mean(x**2, -1) + eps)``.

    Args:
        hidden_size: size of the last dimension.
        eps: added to the mean square (``rms_norm_eps`` in HF configs).
        dtype: dtype of ``weight`` (the serving dtype).

    Input ``[..., hidden_size]`` of any float dtype; output has the same shape
    and dtype.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fast_path.ENABLED and x.dtype == torch.float32:
            # The same float32 operations in the same order, with fewer temporaries
            # (no-op casts skipped, the eps add and the weight multiply in place).
            y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(self.eps))
            return y.mul_(self.weight)
        in_dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(in_dtype)
