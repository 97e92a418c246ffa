"""Rotary position embedding (RoPE) with the scalings our models use.

* ``default``: ``inv_freq[i] = theta ** (-2i / d)`` (Su et al. 2021).
* ``llama3``: Llama 3.1's frequency-dependent rescaling (low frequencies divided
  by ``factor``, high ones kept, a smooth ramp between; see Meta's Llama 3.1
  reference code and ``rope_scaling`` in its config.json).
* ``yarn``: YaRN (Peng et al. 2023, arXiv:2309.00071) as DeepSeek-V2/V3 use it:
  a linear ramp between interpolated and extrapolated frequencies over the
  correction range given by ``beta_fast`` / ``beta_slow``, plus an attention
  factor ("mscale") that multiplies cos and sin, and -- for MLA -- a softmax
  scale multiplied by ``mscale(factor, mscale_all_dim) ** 2``
  (:func:`mla_softmax_scale`).

Two layouts of the rotated dimensions:

* ``neox`` (Llama): dimension ``i`` pairs with ``i + d/2``.
* ``interleaved`` (DeepSeek): dimensions ``2i`` and ``2i+1`` form a pair. We
  gather the even and odd dimensions into two halves and then rotate as in
  ``neox``, so the rotated output is laid out de-interleaved. Queries and keys
  get the same permutation, so every dot product (and thus attention) is
  unchanged; the KV cache stores keys in this de-interleaved layout.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def get_rope_parameters(config: Any) -> dict:
    """The RoPE parameters of an HF config as one dict (``rope_type``,
    ``rope_theta`` and the scaling fields).

    Reads ``config.rope_parameters`` (transformers >= 5) and falls back to the
    older ``rope_theta`` + ``rope_scaling`` fields.
    """
    params = getattr(config, "rope_parameters", None)
    if params:
        out = dict(params)
    else:
        out = dict(getattr(config, "rope_scaling", None) or {})
        out.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    rope_type = out.get("rope_type", out.get("type", "default"))
    out["rope_type"] = rope_type
    return out


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    """YaRN's attention temperature term: ``0.1 * mscale * ln(scale) + 1`` for
    ``scale > 1``, else 1 (YaRN paper, eq. 22; DeepSeek-V2 config semantics)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _default_inv_freq(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3_inv_freq(dim: int, p: dict) -> torch.Tensor:
    inv_freq = _default_inv_freq(dim, p["rope_theta"])
    factor = p["factor"]
    low_ff = p["low_freq_factor"]
    high_ff = p["high_freq_factor"]
    old_ctx = p["original_max_position_embeddings"]
    low_wavelen = old_ctx / low_ff
    high_wavelen = old_ctx / high_ff
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low_ff) / (high_ff - low_ff)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def yarn_inv_freq_and_mscale(dim: int, p: dict, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """YaRN inverse frequencies ``[dim / 2]`` (float32) and the cos/sin factor.

    ``p`` holds ``rope_theta``, ``factor`` (None: ``max_position_embeddings /
    original_max_position_embeddings``), ``original_max_position_embeddings``,
    optional ``beta_fast`` (32), ``beta_slow`` (1), ``mscale``,
    ``mscale_all_dim``, ``attention_factor``, ``truncate`` (True).
    """
    base = p["rope_theta"]
    orig = p["original_max_position_embeddings"]
    factor = p.get("factor") or max_position_embeddings / orig
    beta_fast = p.get("beta_fast") or 32
    beta_slow = p.get("beta_slow") or 1

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        ms, ms_all = p.get("mscale"), p.get("mscale_all_dim")
        if ms and ms_all:
            attention_factor = yarn_get_mscale(factor, ms) / yarn_get_mscale(factor, ms_all)
        else:
            attention_factor = yarn_get_mscale(factor)

    def correction_dim(rotations: float) -> float:
        # The dimension whose wavelength completes `rotations` turns over `orig` positions.
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolate = 1 - ramp  # 1: keep the original frequency, 0: divide it by `factor`
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    inv_extra = 1.0 / pos_freqs
    inv_inter = 1.0 / (factor * pos_freqs)
    inv_freq = inv_inter * (1 - extrapolate) + inv_extra * extrapolate
    return inv_freq, float(attention_factor)


def rope_inv_freq(dim: int, params: dict, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """``(inv_freq [dim/2] float32, cos/sin factor)`` for ``params['rope_type']``.

    Raises ValueError for a rope type we do not implement.
    """
    kind = params["rope_type"]
    if kind == "default":
        return _default_inv_freq(dim, params["rope_theta"]), 1.0
    if kind == "linear":
        return _default_inv_freq(dim, params["rope_theta"]) / params["factor"], 1.0
    if kind == "llama3":
        return _llama3_inv_freq(dim, params), 1.0
    if kind == "yarn":
        return yarn_inv_freq_and_mscale(dim, params, max_position_embeddings)
    raise ValueError(f"unsupported rope_type {kind!r}")


def mla_softmax_scale(qk_head_dim: int, params: dict) -> float:
    """DeepSeek MLA softmax scale: ``qk_head_dim ** -0.5``, times
    ``yarn_get_mscale(factor, mscale_all_dim) ** 2`` under YaRN with
    ``mscale_all_dim`` set (DeepSeek-V2 modelling code)."""
    scale = qk_head_dim ** -0.5
    if params.get("rope_type", "default") != "default":
        ms_all = params.get("mscale_all_dim", 0)
        if ms_all:
            m = yarn_get_mscale(params["factor"], ms_all)
            scale = scale * m * m
    return scale


class RotaryEmbedding(nn.Module):
    """Applies RoPE to queries and keys at given positions.

    Args:
        rotary_dim: number of rotated dimensions (the whole head for Llama,
            ``qk_rope_head_dim`` for MLA).
        params: :func:`get_rope_parameters` output.
        max_position_embeddings: from the config (YaRN's default factor).
        max_position: positions ``0 .. max_position - 1`` are precomputed;
            the cache grows on demand beyond that.
        interleaved: DeepSeek's pair layout (see module docstring).

    ``forward(positions [T] int64, q [T, hq, d], k [T, hk, d])`` returns the
    rotated ``(q, k)`` in the input dtype. cos/sin are computed in float32
    as ``positions * inv_freq``, the same product transformers forms.
    """

    def __init__(self, rotary_dim: int, params: dict, max_position_embeddings: int,
                 max_position: int | None = None, interleaved: bool = False):
        super().__init__()
        self.rotary_dim = rotary_dim
        self.interleaved = interleaved
        inv_freq, self.attention_factor = rope_inv_freq(rotary_dim, params, max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._last_positions: torch.Tensor | None = None
        self._last_cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None
        self._last_full: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        self._build(max_position or max_position_embeddings)

    def _build(self, n: int) -> None:
        freqs = torch.arange(n, dtype=torch.int64).float()[:, None] * self.inv_freq[None, :]
        self.cos_cache = freqs.cos() * self.attention_factor
        self.sin_cache = freqs.sin() * self.attention_factor

    def prepare(self, positions: torch.Tensor) -> None:
        """Look up cos/sin for this forward's ``positions`` once; every layer then
        reuses them (call at the start of each model forward)."""
        self._last_positions, self._last_cos_sin = positions, self._lookup(positions)
        self._last_full = {}

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[T, rotary_dim / 2]`` float32 for ``positions`` ``[T]``
        (the :meth:`prepare`-d ones when it is the same tensor)."""
        if positions is self._last_positions:
            return self._last_cos_sin
        return self._lookup(positions)

    def _lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # The growth check reads positions on the host, which a CUDA graph capture forbids
        # (and which would split a torch.compile graph); captured / compiled decode
        # positions stay below the model runner's max_context_len, which the cache covers.
        capturing = torch.compiler.is_compiling() or (positions.is_cuda and torch.cuda.is_current_stream_capturing())
        if not capturing and positions.numel() and int(positions.max()) >= self.cos_cache.shape[0]:
            self._build(max(int(positions.max()) + 1, 2 * self.cos_cache.shape[0]))
        if self.cos_cache.device != positions.device:
            self.cos_cache = self.cos_cache.to(positions.device)
            self.sin_cache = self.sin_cache.to(positions.device)
        return self.cos_cache[positions], self.sin_cache[positions]

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[T, h, rotary_dim]`` with cos/sin ``[T, rotary_dim/2]``."""
        if self.interleaved:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            half = x.shape[-1] // 2
            x1, x2 = x[..., :half], x[..., half:]
        c = cos.unsqueeze(1).to(x.dtype)
        s = sin.unsqueeze(1).to(x.dtype)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)

    def rotate_heads(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotate all heads of ``x`` ``[T, h, d]`` (``neox`` layout, ``d == rotary_dim``) in one go.

        Used for the queries and keys of a layer together (one call instead of two).
        Bit for bit what :meth:`rotate` gives: ``x * [c, c] + [x2, x1] * [-s, s]``
        is ``[x1 c - x2 s, x2 c + x1 s]`` with the same roundings (negation is exact
        and ``a + (-b) == a - b``); ``[x2, x1]`` is one ``roll`` of the last dim by
        ``d / 2``. The cos/sin rows ``[c, c]`` and ``[-s, s]`` (``[T, 1, d]``, ``x``'s
        dtype) are made once per :meth:`prepare` and shared by every layer.
        Returns a new ``[T, h, d]`` tensor.
        """
        if positions is self._last_positions:
            full = self._last_full.get(x.dtype)
            if full is None:
                full = self._last_full[x.dtype] = self._full_cos_sin(*self._last_cos_sin, x.dtype)
        else:
            full = self._full_cos_sin(*self._lookup(positions), x.dtype)
        c, s = full
        rot = torch.roll(x, x.shape[-1] // 2, dims=-1)
        out = x * c
        return out.add_(rot.mul_(s))

    @staticmethod
    def _full_cos_sin(cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        c, s = cos.to(dtype), sin.to(dtype)
        return torch.cat((c, c), dim=-1).unsqueeze(1), torch.cat((-s, s), dim=-1).unsqueeze(1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin(positions)
        return self.rotate(q, cos, sin), self.rotate(k, cos, sin)
