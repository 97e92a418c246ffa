"""DeepseekV2ForCausalLM and DeepseekV3ForCausalLM: MLA attention
(:mod:`fleetserve.layers.mla`) and DeepSeekMoE (:mod:`fleetserve.layers.moe`).

Layer ``i`` uses a dense gated MLP when ``i < first_k_dense_replace`` (or
``i % moe_layer_freq != 0``), else the MoE. V2 and V3 differ only in the
router (softmax vs sigmoid with ``e_score_correction_bias``) and in V3's
``rope_interleave`` flag (V2 always interleaves). V3's multi-token-prediction
layers (past ``num_hidden_layers``) are not loaded.

Parallel layout: attention and embedding / LM head over the attention-TP
group; the dense MLP and the shared experts over the full TP group; routed
experts over EP x MoE-TP. Under DP attention the FFN input of every rank is
gathered before ``mlp`` and scattered after it (issue 5's hooks belong
around the ``self.mlp(...)`` call in :meth:`DeepseekDecoderLayer.forward`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from fleetserve.distributed.dp_attention import gather_tokens, scatter_tokens
from fleetserve.distributed.parallel_state import SINGLE, ParallelState
from fleetserve.engine.kv_pool import MLAKVPool
from fleetserve.layers.attention import AttentionMetadata
from fleetserve.layers.linear import ParallelLMHead, VocabParallelEmbedding, attn_tp_group, full_tp_group
from fleetserve.layers.mla import MLAttention
from fleetserve.layers.mlp import GatedMLP
from fleetserve.layers.moe import DeepseekMoE
from fleetserve.layers.norm import RMSNorm
from fleetserve.layers.rotary import RotaryEmbedding, get_rope_parameters


def is_moe_layer(config: Any, i: int) -> bool:
    """Whether layer ``i`` uses the MoE (DeepSeek's ``first_k_dense_replace`` / ``moe_layer_freq``)."""
    freq = getattr(config, "moe_layer_freq", 1) or 1
    return bool(config.n_routed_experts) and i >= (config.first_k_dense_replace or 0) and i % freq == 0


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_id: int, rotary: RotaryEmbedding, pstate: ParallelState,
                 dtype: torch.dtype):
        super().__init__()
        H = config.hidden_size
        self.layer_id = layer_id
        self.pstate = pstate
        self.self_attn = MLAttention(config, layer_id, rotary, attn_tp_group(pstate), dtype)
        self.is_moe = is_moe_layer(config, layer_id)
        if self.is_moe:
            self.mlp: nn.Module = DeepseekMoE(config, pstate, dtype)
        else:
            self.mlp = GatedMLP(H, config.intermediate_size, config.hidden_act, tp=full_tp_group(pstate), dtype=dtype)
        self.input_layernorm = RMSNorm(H, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(H, config.rms_norm_eps, dtype)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, pool: MLAKVPool) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), meta, pool)
        return x + self._ffn(self.post_attention_layernorm(x), meta)

    def _ffn(self, h: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The MLP / MoE; under DP attention on every group's tokens (gathered, then own rows kept)."""
        ps = self.pstate
        if ps.attn_dp_size == 1:
            return self.mlp(h)
        dispatcher = getattr(self.mlp, "dispatcher", None)
        if dispatcher is not None and not dispatcher.wants_dp_gather:  # all_to_all sends own tokens
            return self.mlp(h, replicated_over_tp=False)
        counts = meta.global_num_tokens
        return scatter_tokens(self.mlp(gather_tokens(h, counts, ps)), counts, ps)

    def load(self, source: Any, prefix: str) -> None:
        self.self_attn.load(source, f"{prefix}.self_attn")
        self.mlp.load(source, f"{prefix}.mlp")
        self.input_layernorm.weight.copy_(source.read(f"{prefix}.input_layernorm.weight"))
        self.post_attention_layernorm.weight.copy_(source.read(f"{prefix}.post_attention_layernorm.weight"))


class DeepseekForCausalLM(nn.Module):
    """DeepSeek-V2 / V3 decoder (one class; the config selects the router).

    ``forward(input_ids [T], meta, pool) -> hidden [T, H]``;
    ``compute_logits(hidden [N, H]) -> [N, vocab]`` float32.
    """

    kv_pool_class = MLAKVPool

    def __init__(self, config: Any, pstate: ParallelState = SINGLE, dtype: torch.dtype = torch.float32,
                 max_position: int | None = None):
        super().__init__()
        self.config = config
        self.pstate = pstate
        self.dtype = dtype
        H = config.hidden_size
        tp = attn_tp_group(pstate)
        interleaved = getattr(config, "model_type", "") != "deepseek_v3" or bool(getattr(config, "rope_interleave", True))
        self.rotary = RotaryEmbedding(config.qk_rope_head_dim, get_rope_parameters(config),
                                      config.max_position_embeddings,
                                      max_position=max_position or min(config.max_position_embeddings, 1 << 16),
                                      interleaved=interleaved)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, H, tp, dtype)
        self.layers = nn.ModuleList(
            [DeepseekDecoderLayer(config, i, self.rotary, pstate, dtype) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(H, config.rms_norm_eps, dtype)
        tied = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.vocab_size, H, tp, dtype, tied_to=self.embed_tokens if tied else None)

    def kv_pool_kwargs(self) -> dict:
        """Arguments for :class:`MLAKVPool`: the whole latent on every rank."""
        return dict(num_layers=len(self.layers), kv_lora_rank=self.config.kv_lora_rank,
                    qk_rope_head_dim=self.config.qk_rope_head_dim)

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Layers x (kv_lora_rank + qk_rope_head_dim) x element size (the same on every rank)."""
        elem = torch.tensor([], dtype=dtype).element_size()
        return len(self.layers) * (self.config.kv_lora_rank + self.config.qk_rope_head_dim) * elem

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, pool: MLAKVPool) -> torch.Tensor:
        self.rotary.prepare(meta.positions)
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, meta, pool)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def weight_loaders(self, source: Any) -> list[tuple[str, Callable[[], None]]]:
        """``(label, fn)`` steps reading this rank's weights (local experts only)."""
        steps: list[tuple[str, Callable[[], None]]] = [
            ("embed_tokens", lambda: self.embed_tokens.load(source, "model.embed_tokens.weight")),
            ("norm", lambda: self.norm.weight.copy_(source.read("model.norm.weight"))),
        ]
        if not self.lm_head.tied:
            name = "lm_head.weight" if source.has("lm_head.weight") else "model.embed_tokens.weight"
            steps.append(("lm_head", lambda: self.lm_head.load(source, name)))
        for i, layer in enumerate(self.layers):
            steps.append((f"layer {i}", lambda i=i, layer=layer: layer.load(source, f"model.layers.{i}")))
        return steps
