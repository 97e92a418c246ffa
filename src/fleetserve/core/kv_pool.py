"""The KV cache: a preallocated pool of token slots.

Two parts, kept apart as in SGLang:

* :class:`TokenSlotAllocator` hands out slot indices (free list).
* A storage class holds, per layer, the cached tensors of every slot:
  :class:`MHAKVPool` keeps per-head K and V (Llama, GQA);
  :class:`MLAKVPool` keeps the compressed latent ``c_kv`` plus the shared rope
  key ``k_pe`` (DeepSeek MLA), which is why MLA's KV is small.

Slot 0 is reserved as a scratch slot: padded or dummy tokens write there, so
valid slots are ``1 .. size``.
"""

from __future__ import annotations

import torch


class TokenSlotAllocator:
    """Free list of KV slots ``1 .. size``.

    Args:
        size: number of usable token slots.
    """

    def __init__(self, size: int):
        if size <= 0:
            raise ValueError(f"KV pool size must be positive, got {size}")
        self.size = size
        self.clear()

    def clear(self) -> None:
        self._free = torch.arange(1, self.size + 1, dtype=torch.int64)
        self._num_free = self.size

    def available_size(self) -> int:
        return self._num_free

    def alloc(self, n: int) -> torch.Tensor | None:
        """Take ``n`` slots; int64 ``[n]``, or ``None`` if fewer than ``n`` are free."""
        if n > self._num_free:
            return None
        start = self._num_free - n
        out = self._free[start : self._num_free].clone()
        self._num_free = start
        return out

    def free(self, indices: torch.Tensor) -> None:
        """Give slots back. ``indices``: int64 ``[k]``, each currently allocated."""
        k = int(indices.numel())
        if k == 0:
            return
        end = self._num_free + k
        if end > self.size:
            raise RuntimeError("freeing more KV slots than were allocated")
        self._free[self._num_free : end] = indices.to(torch.int64).flatten()
        self._num_free = end

    def free_slots(self) -> torch.Tensor:
        """The currently free slot indices (a copy), for invariant checks."""
        return self._free[: self._num_free].clone()


class MHAKVPool:
    """Per-layer K and V for multi-head / grouped-query attention.

    ``k_buffer[l]`` and ``v_buffer[l]``: ``[size + 1, num_kv_heads, head_dim]``.
    """

    def __init__(self, size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu",
                 v_head_dim: int | None = None):
        v_head_dim = head_dim if v_head_dim is None else v_head_dim
        self.size = size
        self.dtype = dtype
        self.k_buffer = [torch.zeros(size + 1, num_kv_heads, head_dim, dtype=dtype, device=device)
                         for _ in range(num_layers)]
        self.v_buffer = [torch.zeros(size + 1, num_kv_heads, v_head_dim, dtype=dtype, device=device)
                         for _ in range(num_layers)]
        elem = torch.tensor([], dtype=dtype).element_size()
        self.bytes_per_token = num_layers * num_kv_heads * (head_dim + v_head_dim) * elem

    def set_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k``/``v`` (``[n, num_kv_heads, head_dim]``) to slots ``loc`` (``[n]``)."""
        self.k_buffer[layer][loc] = k.to(self.dtype)
        self.v_buffer[layer][loc] = v.to(self.dtype)


class MLAKVPool:
    """Per-layer compressed MLA cache: ``[size + 1, kv_lora_rank + qk_rope_head_dim]``.

    Columns ``[:kv_lora_rank]`` hold the normalised latent ``c_kv``; the last
    ``qk_rope_head_dim`` columns hold the rotated, head-shared rope key ``k_pe``.
    """

    def __init__(self, size: int, num_layers: int, kv_lora_rank: int, qk_rope_head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.size = size
        self.dtype = dtype
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.kv_buffer = [torch.zeros(size + 1, kv_lora_rank + qk_rope_head_dim, dtype=dtype, device=device)
                          for _ in range(num_layers)]
        elem = torch.tensor([], dtype=dtype).element_size()
        self.bytes_per_token = num_layers * (kv_lora_rank + qk_rope_head_dim) * elem

    def set_kv(self, layer: int, loc: torch.Tensor, latent_and_rope: torch.Tensor) -> None:
        """Write ``[n, kv_lora_rank + qk_rope_head_dim]`` rows to slots ``loc`` (``[n]``)."""
        self.kv_buffer[layer][loc] = latent_and_rope.to(self.dtype)
