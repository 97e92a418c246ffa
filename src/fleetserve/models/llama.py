"""LlamaForCausalLM (Llama 2/3, SmolLM2, Mistral without sliding window):
GQA attention with RoPE (default / llama3 / linear scaling), SwiGLU MLP,
RMSNorm, optionally tied embeddings.

Parallel layout: heads, embedding and LM head over the attention-TP group;
the MLP over the full TP group (the same group unless DP attention is on,
which Llama does not use).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fleetserve.distributed.parallel_state import SINGLE_RANK_STATE, ParallelState
from fleetserve.core.kv_pool import MHAKVPool
from fleetserve.core.forward_context import ForwardContext
from fleetserve.layers.attention import MHAttention
from fleetserve.layers.linear import attn_tp_group, full_tp_group
from fleetserve.layers.mlp import GatedMLP
from fleetserve.layers.norm import RMSNorm
from fleetserve.layers.smooth_quant import NormGroup, attention_v_group, gated_mlp_group
from fleetserve.layers.rotary import RotaryEmbedding, get_rope_parameters
from fleetserve.models.decoder_lm import DecoderOnlyLM


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_id: int, rotary: RotaryEmbedding, pstate: ParallelState,
                 dtype: torch.dtype):
        super().__init__()
        h = config.hidden_size
        head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
        self.self_attn = MHAttention(
            layer_id, h, config.num_attention_heads, config.num_key_value_heads, head_dim, rotary,
            tp=attn_tp_group(pstate), bias=bool(getattr(config, "attention_bias", False)),
            o_bias=bool(getattr(config, "attention_bias", False)), dtype=dtype)
        self.mlp = GatedMLP(h, config.intermediate_size, config.hidden_act, tp=full_tp_group(pstate), dtype=dtype,
                            bias=bool(getattr(config, "mlp_bias", False)))
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps, dtype)

    def forward(self, x: torch.Tensor, meta: ForwardContext, pool: MHAKVPool) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), meta, pool)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(DecoderOnlyLM):
    """The Llama decoder.

    Args:
        config: a transformers ``LlamaConfig`` (or compatible).
        pstate: this rank's :class:`ParallelState`.
        dtype: serving dtype of weights and activations.
        max_position: RoPE positions to precompute.

    ``forward(input_ids [T], meta, pool) -> hidden [T, H]`` (final-normed);
    ``compute_logits(hidden [N, H]) -> [N, vocab]`` float32.
    """

    def __init__(self, config: Any, pstate: ParallelState = SINGLE_RANK_STATE, dtype: torch.dtype = torch.float32,
                 max_position: int | None = None):
        super().__init__()
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rotary = RotaryEmbedding(self.head_dim, get_rope_parameters(config), config.max_position_embeddings,
                                 max_position=max_position or config.max_position_embeddings)
        self.build_trunk(config, pstate, dtype, rotary,
                         lambda i: LlamaDecoderLayer(config, i, rotary, pstate, dtype))

    # ---- KV pool ---------------------------------------------------------------------------
    def kv_pool_kwargs(self) -> dict:
        """Arguments for :class:`MHAKVPool` (this rank's KV heads)."""
        return dict(num_layers=len(self.layers), num_kv_heads=self.layers[0].self_attn.num_kv_heads,
                    head_dim=self.head_dim)

    kv_pool_class = MHAKVPool

    # ---- int8 smoothing (SmoothQuant, layers/smooth_quant.py) --------------------------------
    def int8_smoothing_groups(self) -> list:
        """Where ``--quantization int8`` may fold SmoothQuant's ``1/s``, in a fixed order (same on every rank).

        Per layer: ``input_layernorm`` -> QKV, V rows -> O (no QKV bias), ``post_attention_layernorm``
        -> gate/up, up rows -> down (no gate/up bias); then the final norm -> LM head.
        """
        groups: list = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            groups.append(NormGroup(layer.input_layernorm, [attn.qkv_proj], attn.qkv_proj.tp.group,
                                    attn.qkv_proj.tp.size))
            if attn.qkv_proj.bias is None:
                groups.append(attention_v_group(attn))
            groups.append(NormGroup(layer.post_attention_layernorm, [mlp.gate_up_proj], mlp.gate_up_proj.tp.group,
                                    mlp.gate_up_proj.tp.size))
            if mlp.gate_up_proj.bias is None:
                groups.append(gated_mlp_group(mlp))
        head = self.lm_head
        groups.append(NormGroup(self.norm, [head], head.tp.group, head.tp.size))
        return groups

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """KV bytes one token takes on this rank: layers x local KV heads x (K + V) x head_dim."""
        kw = self.kv_pool_kwargs()
        elem = torch.tensor([], dtype=dtype).element_size()
        return kw["num_layers"] * kw["num_kv_heads"] * 2 * kw["head_dim"] * elem

    # ---- weights ---------------------------------------------------------------------------
    def load_layer(self, source: Any, i: int, layer: LlamaDecoderLayer) -> None:
        p = f"model.layers.{i}"
        attn = layer.self_attn
        has_bias = attn.qkv_proj.bias is not None
        for part, n in enumerate(("q_proj", "k_proj", "v_proj")):
            attn.qkv_proj.load(source, f"{p}.self_attn.{n}.weight", part,
                               f"{p}.self_attn.{n}.bias" if has_bias else None)
        attn.o_proj.load(source, f"{p}.self_attn.o_proj.weight",
                         f"{p}.self_attn.o_proj.bias" if attn.o_proj.bias is not None else None)
        layer.mlp.load(source, f"{p}.mlp")
        layer.input_layernorm.weight.copy_(source.read(f"{p}.input_layernorm.weight"))
        layer.post_attention_layernorm.weight.copy_(source.read(f"{p}.post_attention_layernorm.weight"))
