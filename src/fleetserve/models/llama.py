"""LlamaForCausalLM (Llama 2/3, SmolLM2, Mistral without sliding window):
GQA attention with RoPE (default / llama3 / linear scaling), SwiGLU MLP,
RMSNorm, optionally tied embeddings.

Parallel layout: heads, embedding and LM head over the attention-TP group;
the MLP over the full TP group (the same group unless DP attention is on,
which Llama does not use).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from fleetserve.distributed.parallel_state import SINGLE, ParallelState
from fleetserve.engine.kv_pool import MHAKVPool
from fleetserve.layers.attention import AttentionMetadata, MHAttention
from fleetserve.layers.linear import ParallelLMHead, VocabParallelEmbedding, attn_tp_group, full_tp_group
from fleetserve.layers.mlp import GatedMLP
from fleetserve.layers.norm import RMSNorm
from fleetserve.layers.rotary import RotaryEmbedding, get_rope_parameters


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

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, pool: MHAKVPool) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), meta, pool)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """The Llama decoder.

    Args:
        config: a transformers ``LlamaConfig`` (or compatible).
        pstate: this rank's :class:`ParallelState`.
        dtype: serving dtype of weights and activations.
        max_position: RoPE positions to precompute.

    ``forward(input_ids [T], meta, pool) -> hidden [T, H]`` (final-normed);
    ``compute_logits(hidden [N, H]) -> [N, vocab]`` float32.
    """

    def __init__(self, config: Any, pstate: ParallelState = SINGLE, dtype: torch.dtype = torch.float32,
                 max_position: int | None = None):
        super().__init__()
        self.config = config
        self.pstate = pstate
        self.dtype = dtype
        h = config.hidden_size
        self.head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
        tp = attn_tp_group(pstate)
        self.rotary = RotaryEmbedding(self.head_dim, get_rope_parameters(config), config.max_position_embeddings,
                                      max_position=max_position or config.max_position_embeddings)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, h, tp, dtype)
        self.layers = nn.ModuleList(
            [LlamaDecoderLayer(config, i, self.rotary, pstate, dtype) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(h, config.rms_norm_eps, dtype)
        tied = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.vocab_size, h, tp, dtype, tied_to=self.embed_tokens if tied else None)

    # ---- KV pool ---------------------------------------------------------------------------
    def kv_pool_kwargs(self) -> dict:
        """Arguments for :class:`MHAKVPool` (this rank's KV heads)."""
        return dict(num_layers=len(self.layers), num_kv_heads=self.layers[0].self_attn.num_kv_heads,
                    head_dim=self.head_dim)

    kv_pool_class = MHAKVPool

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """KV bytes one token takes on this rank: layers x local KV heads x (K + V) x head_dim."""
        kw = self.kv_pool_kwargs()
        elem = torch.tensor([], dtype=dtype).element_size()
        return kw["num_layers"] * kw["num_kv_heads"] * 2 * kw["head_dim"] * elem

    # ---- forward ---------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, pool: MHAKVPool) -> torch.Tensor:
        self.rotary.prepare(meta.positions)
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, meta, pool)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    # ---- weights ---------------------------------------------------------------------------
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
            steps.append((f"layer {i}", lambda i=i, layer=layer: self._load_layer(source, i, layer)))
        return steps

    def _load_layer(self, source: Any, i: int, layer: LlamaDecoderLayer) -> None:
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
