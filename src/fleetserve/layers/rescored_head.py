"""An int8 (or bfloat16) LM head whose top candidates are recomputed in float32 (issue 16).

Greedy decoding needs the argmax of the logits, not every logit exactly. The int8 W8A8 head
(:class:`~fleetserve.layers.quantization.Int8DynamicGemm`, the cheapest gemm for SmolLM2's
``[49152, 576]`` head on AVX2) errs by a few percent of the logits' spread, which flips near
ties; here the ``k`` largest int8 logits of each row are recomputed exactly (float32 dot
products of the hidden row with those ``k`` weight rows) and written back, so the argmax is
float32's whenever float32's top token is among the int8 top ``k`` (at a ~2.5% logit error
it always was on the measured text). The other logits keep the int8 value. The same idea as
candidate re-ranking with a cheap scorer first; the cost is one ``[N, k, in]`` gather.

Under vocabulary-sharded tensor parallelism each rank rescores its own shard's top ``k``, so
the global argmax is still exact under the same condition. :class:`RescoredHead` takes any
cheap gemm (``--quantization bf16_linear`` uses a bfloat16 one); :class:`RescoredInt8Head` is
the int8 benchmark variant (``int8-head`` in ``benchmarks/quant_modes.py``).
"""

from __future__ import annotations

import torch

from fleetserve.layers.quantization import Int8DynamicGemm

#: Candidates recomputed per row (``--quantization bf16_linear``'s head and the int8 variant).
TOP_K = 16


class RescoredHead:
    """``logits = cheap(h)``, then the top ``k`` per row recomputed in float32; same call as the other gemms.

    ``weight``: float32 ``[vocab (shard), hidden]`` (kept by reference, not copied); ``cheap``:
    a gemm object (``cheap(x, None, bias)``) of the same weight; ``x``: ``[..., hidden]``;
    returns float32-or-``x.dtype`` ``[..., vocab]``.
    """

    __slots__ = ("_cheap", "_w", "_k")

    def __init__(self, weight: torch.Tensor, cheap, k: int = TOP_K) -> None:
        self._cheap = cheap
        self._w = weight.detach()
        self._k = min(int(k), int(weight.shape[0]))

    def __call__(self, x: torch.Tensor, weight: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        y = self._cheap(x, None, bias)
        shape = y.shape
        y2 = y.reshape(-1, shape[-1])
        if y2.shape[0] == 0:
            return y
        x2 = x.reshape(-1, x.shape[-1]).float()
        idx = y2.topk(self._k, dim=-1).indices  # [N, k]
        exact = torch.bmm(self._w[idx].float(), x2.unsqueeze(-1)).squeeze(-1)  # [N, k]
        if bias is not None:
            exact = exact + bias.float()[idx]
        y2.scatter_(1, idx, exact.to(y2.dtype))
        return y2.reshape(shape)


class RescoredInt8Head(RescoredHead):
    """:class:`RescoredHead` over fbgemm's int8 gemm (``int8_kwargs``: :class:`Int8DynamicGemm`'s)."""

    __slots__ = ()

    def __init__(self, weight: torch.Tensor, k: int = TOP_K, **int8_kwargs) -> None:
        super().__init__(weight, Int8DynamicGemm(weight, **int8_kwargs), k)
