"""Multi-head latent attention (MLA; DeepSeek-V2 paper, arXiv:2405.04434, sec. 2.1)
over :class:`MLAKVPool`.

Per token, MLA compresses keys and values into one latent
``c_kv = RMSNorm(W_DKV x)`` of ``kv_lora_rank`` (r) numbers plus one rotated
rope key ``k_pe`` of ``qk_rope_head_dim`` (dr) numbers shared by all heads.
Only these ``r + dr`` numbers per layer go into the KV pool (not per-head K
and V), which is why MLA's KV is small. Per head ``h`` the full key and value
would be ``k_h = [W_UK_h c_kv ; k_pe]`` and ``v_h = W_UV_h c_kv``, where
``kv_b_proj`` stacks ``W_UK`` (``qk_nope_head_dim`` rows per head) and ``W_UV``
(``v_head_dim`` rows per head).

Two equivalent ways to attend:

* **Absorbed** (used for DECODE): ``q_nope_h . (W_UK_h c) = (W_UK_h^T q_nope_h) . c``,
  so fold ``W_UK`` into the query (``q_lat [T, h, r]``), attend with query
  ``[q_lat ; q_pe]`` over keys ``[c_kv ; k_pe]`` and values ``c_kv`` read straight
  from the pool (one shared KV "head", like MQA), then apply ``W_UV`` to the
  per-head latent output. Nothing per-head is ever built for cached tokens,
  so decode reads ``r + dr`` numbers per cached token per layer.
* **Expanded** (used for EXTEND): rebuild per-head ``k_nope`` and ``v`` from the
  gathered latents with ``kv_b_proj`` and run ordinary attention; cheaper
  when many new tokens share the expansion cost.

Under attention TP, heads are split over ranks (``q_b_proj``/``q_proj`` and
``kv_b_proj`` column-parallel, ``o_proj`` row-parallel) while ``q_a_proj`` and
``kv_a_proj_with_mqa`` are replicated: every rank keeps the whole latent KV.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fleetserve.core.forward_batch import ForwardMode
from fleetserve.core.kv_pool import MLAKVPool
from fleetserve.core.forward_context import ForwardContext
from fleetserve.layers.attention import attend, gather_rows
from fleetserve.layers.linear import UNSHARDED, ColumnParallelLinear, RowParallelLinear, TPGroup
from fleetserve.layers.norm import RMSNorm
from fleetserve.layers.rotary import RotaryEmbedding, get_rope_parameters, mla_softmax_scale


class MLAttention(nn.Module):
    """DeepSeek MLA for one layer.

    Args:
        config: a DeepSeek-V2/V3 HF config (``q_lora_rank`` may be None,
            ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``,
            ``v_head_dim``, ``num_attention_heads``, ``attention_bias``).
        layer_id: index into the pool's per-layer buffers.
        rotary: the shared rotary embedding (interleaved for DeepSeek).
        tp: attention-TP group (heads are split over it).

    ``forward(hidden [T, H], meta, pool) -> [T, H]``.
    """

    def __init__(self, config: Any, layer_id: int, rotary: RotaryEmbedding, tp: TPGroup = UNSHARDED,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        H = config.hidden_size
        nh = config.num_attention_heads
        if nh % tp.size:
            raise ValueError(f"{nh} attention heads are not divisible by attention TP size {tp.size}")
        self.layer_id = layer_id
        self.num_heads = nh // tp.size
        self.q_lora_rank = config.q_lora_rank
        self.r = config.kv_lora_rank
        self.dn = config.qk_nope_head_dim
        self.dr = config.qk_rope_head_dim
        self.dv = config.v_head_dim
        self.qk_head_dim = self.dn + self.dr
        bias = bool(getattr(config, "attention_bias", False))
        eps = getattr(config, "rms_norm_eps", 1e-6)
        if self.q_lora_rank:
            self.q_a_proj = ColumnParallelLinear(H, self.q_lora_rank, bias=bias, dtype=dtype)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps, dtype)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, nh * self.qk_head_dim, tp=tp, dtype=dtype)
        else:
            self.q_proj = ColumnParallelLinear(H, nh * self.qk_head_dim, tp=tp, dtype=dtype)
        self.kv_a_proj_with_mqa = ColumnParallelLinear(H, self.r + self.dr, bias=bias, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(self.r, eps, dtype)
        self.kv_b_proj = ColumnParallelLinear(self.r, nh * (self.dn + self.dv), tp=tp, dtype=dtype)
        self.o_proj = RowParallelLinear(nh * self.dv, H, bias=bias, tp=tp, dtype=dtype)
        self.rotary = rotary
        self.scale = mla_softmax_scale(self.qk_head_dim, get_rope_parameters(config))

    def load(self, source: Any, prefix: str) -> None:
        b = self.kv_a_proj_with_mqa.bias is not None
        if self.q_lora_rank:
            self.q_a_proj.load(source, f"{prefix}.q_a_proj.weight", 0, f"{prefix}.q_a_proj.bias" if b else None)
            self.q_a_layernorm.weight.copy_(source.read(f"{prefix}.q_a_layernorm.weight"))
            self.q_b_proj.load(source, f"{prefix}.q_b_proj.weight")
        else:
            self.q_proj.load(source, f"{prefix}.q_proj.weight")
        self.kv_a_proj_with_mqa.load(source, f"{prefix}.kv_a_proj_with_mqa.weight", 0,
                                     f"{prefix}.kv_a_proj_with_mqa.bias" if b else None)
        self.kv_a_layernorm.weight.copy_(source.read(f"{prefix}.kv_a_layernorm.weight"))
        self.kv_b_proj.load(source, f"{prefix}.kv_b_proj.weight")
        self.o_proj.load(source, f"{prefix}.o_proj.weight", f"{prefix}.o_proj.bias" if b else None)

    def _w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of ``kv_b_proj``: ``W_UK [h, dn, r]`` and ``W_UV [h, dv, r]`` (no copy)."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.dn + self.dv, self.r)
        return w[:, : self.dn], w[:, self.dn:]

    def forward(self, hidden: torch.Tensor, meta: ForwardContext, pool: MLAKVPool) -> torch.Tensor:
        T = hidden.shape[0]
        h = self.num_heads
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        else:
            q = self.q_proj(hidden)
        q = q.view(T, h, self.qk_head_dim)
        q_nope, q_pe = q.split([self.dn, self.dr], dim=-1)
        latent = self.kv_a_proj_with_mqa(hidden)
        c_kv, k_pe = latent.split([self.r, self.dr], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)
        q_pe, k_pe = self.rotary(meta.positions, q_pe, k_pe.unsqueeze(1))
        if T:
            pool.set_kv(self.layer_id, meta.out_cache_loc, torch.cat([c_kv, k_pe.squeeze(1)], dim=-1))
        buf = pool.kv_buffer[self.layer_id]  # [P, r + dr]
        w_uk, w_uv = self._w_uk_uv()
        if meta.mode == ForwardMode.DECODE:
            # Absorbed: q_lat[t, h] = W_UK_h^T q_nope[t, h]; attend over [c_kv ; k_pe] directly.
            q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, h, r]
            q_full = torch.cat([q_lat, q_pe], dim=-1)

            def latent_kv(idx):  # one KV "head" shared by all query heads: keys [c_kv ; k_pe], values c_kv
                rows = gather_rows(buf, idx).unsqueeze(2)  # [B, L, 1, r + dr]
                return rows, rows[..., : self.r]

            out_lat = attend(q_full, meta, latent_kv, self.scale)  # [T, h, r]
            out = torch.bmm(out_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [T, h, dv]
        else:
            # Expanded: per-head keys / values rebuilt from the gathered latents.
            def expanded_kv(idx):
                rows = gather_rows(buf, idx)
                B, L = rows.shape[:2]
                kvb = F.linear(rows[..., : self.r], self.kv_b_proj.weight).view(B, L, h, self.dn + self.dv)
                k_nope, v = kvb.split([self.dn, self.dv], dim=-1)
                k = torch.cat([k_nope, rows[..., self.r:].unsqueeze(2).expand(B, L, h, self.dr)], dim=-1)
                return k, v

            out = attend(torch.cat([q_nope, q_pe], dim=-1), meta, expanded_kv, self.scale)
        return self.o_proj(out.reshape(T, h * self.dv))
