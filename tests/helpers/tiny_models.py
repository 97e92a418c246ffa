"""Tiny random models saved as Hugging Face directories (config.json +
safetensors + a byte-level tokenizer), for tests that compare our engine with
transformers' own modelling code.

All are float32 and seeded. Weights are re-drawn with a scale large enough that
attention is not uniform, routing differs from token to token and logits are
spread over several units (so greedy argmaxes are not near-ties):
linear weights ``N(0, (gain / sqrt(fan_in))**2)``, norms ``1 + N(0, 0.1**2)``,
embeddings ``N(0, 1)``; V3's ``e_score_correction_bias`` is non-zero.

Variants (``build_tiny_model(kind, out_dir)``):

* ``llama``: GQA (4 heads, 2 KV heads), llama3 RoPE scaling, untied LM head.
* ``deepseek_v2``: no ``q_lora_rank`` (plain ``q_proj``), ``group_limited_greedy``
  top-k over 4 groups, YaRN RoPE scaling with ``mscale != mscale_all_dim``.
* ``deepseek_v2_greedy``: ``q_lora_rank`` set, ``greedy`` top-k.
* ``deepseek_v3``: ``q_lora_rank`` set, sigmoid router with correction bias,
  ``noaux_tc`` over 4 groups, ``norm_topk_prob``, ``routed_scaling_factor`` 2.5.
"""

from __future__ import annotations

import math
import os

import torch

VOCAB = 320
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, rms_norm_eps=1e-6,
              bos_token_id=256, eos_token_id=257, pad_token_id=258, tie_word_embeddings=False)
DEEPSEEK = dict(intermediate_size=96, moe_intermediate_size=32, kv_lora_rank=32, qk_nope_head_dim=16,
                qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                first_k_dense_replace=1, max_position_embeddings=512, num_key_value_heads=4)

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tiny_config(kind: str):
    """The transformers config of a tiny variant (see module docstring)."""
    from transformers import DeepseekV2Config, DeepseekV3Config, LlamaConfig

    if kind == "llama":
        return LlamaConfig(**COMMON, intermediate_size=96, num_key_value_heads=2, head_dim=16,
                           max_position_embeddings=512,
                           rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 64})
    if kind == "deepseek_v2":
        return DeepseekV2Config(**COMMON, **DEEPSEEK, q_lora_rank=None, topk_method="group_limited_greedy",
                                n_group=4, topk_group=2, norm_topk_prob=False, routed_scaling_factor=1.0,
                                rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                 "original_max_position_embeddings": 128, "beta_fast": 32,
                                                 "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707})
    if kind == "deepseek_v2_greedy":
        return DeepseekV2Config(**COMMON, **DEEPSEEK, q_lora_rank=24, topk_method="greedy", n_group=1, topk_group=1,
                                norm_topk_prob=False, routed_scaling_factor=1.5,
                                rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if kind == "deepseek_v3":
        return DeepseekV3Config(**COMMON, **DEEPSEEK, q_lora_rank=24, n_group=4, topk_group=2, norm_topk_prob=True,
                                routed_scaling_factor=2.5, rope_interleave=True,
                                rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    raise ValueError(f"unknown tiny model kind {kind!r}")


def _reinit(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.ndim == 1:  # norm weights
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                fan_in = p.shape[-1]
                gain = 3.0 if "lm_head" in name else (2.0 if "gate.weight" in name else 1.0)
                p.copy_(torch.randn(p.shape, generator=g) * gain / math.sqrt(fan_in))
        for name, b in sorted(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=g))


def save_byte_tokenizer(out_dir: str) -> None:
    """A byte-level BPE tokenizer without merges: ids 0..255 are bytes, then
    ``<s>`` (256), ``</s>`` (257), ``<pad>`` (258) and chat markers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    # ByteLevel maps byte b to a printable character; order the vocab by byte value.
    from fleetserve.entrypoints.tokenizer_manager import byte_decoder

    table = byte_decoder()
    assert set(table) == set(byte_chars)
    specials = ["<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
    vocab = dict(table)
    for i, s in enumerate(specials):
        vocab[s] = 256 + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   additional_special_tokens=specials[3:])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)


def build_tiny_model(kind: str, out_dir: str, seed: int = 0, max_shard_size: str | None = None) -> str:
    """Build, re-initialise and save a tiny model; returns ``out_dir``.

    ``max_shard_size`` (e.g. ``"60KB"``) writes several safetensors files with
    a ``model.safetensors.index.json``.
    """
    from transformers import AutoModelForCausalLM

    config = tiny_config(kind)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _reinit(model, seed)
    os.makedirs(out_dir, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, **kwargs)
    save_byte_tokenizer(out_dir)
    return out_dir
