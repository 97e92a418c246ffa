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
gathered before ``mlp`` and scattered after it, around the ``self.mlp(...)``
call in :meth:`DeepseekDecoderLayer.forward`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fleetserve.distributed.dp_attention import gather_tokens, scatter_tokens
from fleetserve.distributed.parallel_state import SINGLE_RANK_STATE, ParallelState
from fleetserve.core.kv_pool import MLAKVPool
from fleetserve.core.forward_context import ForwardContext
from fleetserve.layers.linear import attn_tp_group, full_tp_group
from fleetserve.layers.mla import MLAttention
from fleetserve.layers.mlp import GatedMLP
from fleetserve.layers.moe import DeepseekMoE
from fleetserve.layers.norm import RMSNorm
from fleetserve.layers.rotary import RotaryEmbedding, get_rope_parameters
from fleetserve.models.decoder_lm import DecoderOnlyLM


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

    def forward(self, x: torch.Tensor, meta: ForwardContext, pool: MLAKVPool) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), meta, pool)
        return x + self._ffn(self.post_attention_layernorm(x), meta)

    def _ffn(self, h: torch.Tensor, meta: ForwardContext) -> torch.Tensor:
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


class DeepseekForCausalLM(DecoderOnlyLM):
    """DeepSeek-V2 / V3 decoder (one class; the config selects the router).

    ``forward(input_ids [T], meta, pool) -> hidden [T, H]``;
    ``compute_logits(hidden [N, H]) -> [N, vocab]`` float32.
    """

    kv_pool_class = MLAKVPool

    def __init__(self, config: Any, pstate: ParallelState = SINGLE_RANK_STATE, dtype: torch.dtype = torch.float32,
                 max_position: int | None = None):
        super().__init__()
        interleaved = getattr(config, "model_type", "") != "deepseek_v3" or bool(getattr(config, "rope_interleave", True))
        rotary = RotaryEmbedding(config.qk_rope_head_dim, get_rope_parameters(config),
                                 config.max_position_embeddings,
                                 max_position=max_position or min(config.max_position_embeddings, 1 << 16),
                                 interleaved=interleaved)
        self.build_trunk(config, pstate, dtype, rotary,
                         lambda i: DeepseekDecoderLayer(config, i, rotary, pstate, dtype))

    def kv_pool_kwargs(self) -> dict:
        """Arguments for :class:`MLAKVPool`: the whole latent on every rank."""
        return dict(num_layers=len(self.layers), kv_lora_rank=self.config.kv_lora_rank,
                    qk_rope_head_dim=self.config.qk_rope_head_dim)

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Layers x (kv_lora_rank + qk_rope_head_dim) x element size (the same on every rank)."""
        elem = torch.tensor([], dtype=dtype).element_size()
        return len(self.layers) * (self.config.kv_lora_rank + self.config.qk_rope_head_dim) * elem

    def load_layer(self, source: Any, i: int, layer: "DeepseekDecoderLayer") -> None:
        layer.load(source, f"model.layers.{i}")
