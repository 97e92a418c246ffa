"""The trunk every decoder-only model here shares: embedding -> decoder layers ->
final RMSNorm -> LM head, plus the weight-loading steps common to them.

A model subclass builds its rotary embedding and decoder layers, then calls
:meth:`DecoderOnlyLM.build_trunk`, and implements :meth:`DecoderOnlyLM.load_layer`.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from fleetserve.distributed.parallel_state import ParallelState
from fleetserve.core.forward_context import ForwardContext
from fleetserve.layers.linear import ParallelLMHead, VocabParallelEmbedding, attn_tp_group
from fleetserve.layers.norm import RMSNorm


class DecoderOnlyLM(nn.Module):
    """``forward(input_ids [T], meta, pool) -> hidden [T, H]``;
    ``compute_logits(hidden [N, H]) -> [N, vocab]`` float32."""

    def build_trunk(self, config: Any, pstate: ParallelState, dtype: torch.dtype, rotary: nn.Module,
                    make_layer: Callable[[int], nn.Module]) -> None:
        """Create the vocab-parallel embedding, ``num_hidden_layers`` layers from
        ``make_layer(i)``, the final norm and the (possibly tied) LM head."""
        self.config = config
        self.pstate = pstate
        self.dtype = dtype
        self.rotary = rotary
        h = config.hidden_size
        tp = attn_tp_group(pstate)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, h, tp, dtype)
        self.layers = nn.ModuleList([make_layer(i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(h, config.rms_norm_eps, dtype)
        tied = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.vocab_size, h, tp, dtype, tied_to=self.embed_tokens if tied else None)

    def forward(self, input_ids: torch.Tensor, meta: ForwardContext, pool: Any) -> torch.Tensor:
        self.rotary.prepare(meta.positions)
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, meta, pool)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def weight_loaders(self, source: Any) -> list[tuple[str, Callable[[], None]]]:
        """``(label, fn)`` steps that read this rank's weights from ``source``."""
        steps: list[tuple[str, Callable[[], None]]] = [
            ("embed_tokens", lambda: self.embed_tokens.load(source, "model.embed_tokens.weight")),
            ("norm", lambda: self.norm.weight.copy_(source.read("model.norm.weight"))),
        ]
        if not self.lm_head.tied:
            name = "lm_head.weight" if source.has("lm_head.weight") else "model.embed_tokens.weight"
            steps.append(("lm_head", lambda: self.lm_head.load(source, name)))
        for i, layer in enumerate(self.layers):
            steps.append((f"layer {i}", lambda i=i, layer=layer: self.load_layer(source, i, layer)))
        return steps

    def load_layer(self, source: Any, i: int, layer: nn.Module) -> None:
        """Read decoder layer ``i``'s weights (prefix ``model.layers.{i}``)."""
        raise NotImplementedError
