"""The KV cache: a preallocated pool of token slots.

Two parts, kept apart as in SGLang:

* :class:`TokenSlotAllocator` hands out slot indices (free list).
* A storage class holds, per layer, the cached tensors of every slot:
  :class:`MHAKVPool` keeps per-head K and V (Llama, GQA);
  :class:`MLAKVPool` keeps the compressed latent ``c_kv`` plus the shared rope
  key ``k_pe`` (DeepSeek MLA), which is why MLA's KV is small.

Slot 0 is reserved as a scratch slot: padded or dummy tokens write there, so
valid slots are ``1 .. size`` (with ``--page-size N > 1``: slots ``N .. size + N - 1``,
pages ``1 .. size // N``; the storage then needs ``size + N`` rows, see
``TokenSlotAllocator.max_slot``).
"""

from __future__ import annotations

import torch

from fleetserve.core import fast_path


class TokenSlotAllocator:
    """Free list of KV slots, handed out in pages of ``page_size`` contiguous slots.

    Args:
        size: KV pool size in tokens. Rounded down to whole pages (SGLang does
            the same); ``self.size`` is the usable slot count.
        page_size: slots per page (``--page-size``, default 1). Page ``p`` is
            slots ``[p * page_size, (p + 1) * page_size)``; pages ``1 .. num_pages``
            are usable, page 0 holds the scratch slot 0. With ``page_size == 1``
            the valid slots are ``1 .. size`` exactly as before paging existed.

    Raises:
        ValueError: ``size`` not positive, ``page_size < 1``, or a pool smaller than one page.

    Paging follows SGLang's ``PagedTokenToKVPoolAllocator`` (mem_cache/allocator.py):
    a request fills its last page before it takes a new one (:meth:`alloc_extend`),
    and a page is freed as a whole (:meth:`free` frees every page it is given a slot of).

    Order (the rule tests rely on): the free list is a stack whose top is the lowest
    page of a fresh pool (a fresh pool hands out ``1, 2, 3, ...``); every allocation
    returns its pages in ascending order, and :meth:`free` pushes pages back highest
    first, so the next allocation takes the lowest freed page first. Hence a request
    that runs alone on a fresh (or just freed) pool gets one ascending run of slots:
    its prefill takes ``a .. a + n - 1`` and each decode step the next slot, and
    attention reads its K/V as a view of the pool instead of a gather
    (:func:`contiguous_run`).
    """

    def __init__(self, size: int, page_size: int = 1):
        if size <= 0:
            raise ValueError(f"KV pool size must be positive, got {size}")
        if page_size < 1:
            raise ValueError(f"--page-size must be >= 1, got {page_size}")
        if size < page_size:
            raise ValueError(f"--page-size {page_size} does not fit in the KV pool of {size} tokens "
                             f"(--max-total-tokens); the pool must hold at least one page")
        self.page_size = int(page_size)
        self.num_pages = int(size) // self.page_size
        self.size = self.num_pages * self.page_size
        #: largest valid slot index (KV buffers need ``max_slot + 1`` rows)
        self.max_slot = self.size + self.page_size - 1
        self.clear()

    def clear(self) -> None:
        top = self.size if self.page_size == 1 else self.num_pages  # slot ids, or page ids
        self._free = torch.arange(top, 0, -1, dtype=torch.int64)  # stack top (the end) = lowest
        self._num_free = self._free.numel()

    def available_size(self) -> int:
        """Free slots (tokens); always whole pages."""
        return self._num_free * self.page_size

    def _take_pages(self, k: int) -> torch.Tensor | None:
        if k > self._num_free:
            return None
        start = self._num_free - k
        out = self._free[start: self._num_free].flip(0)  # top of the stack first (a copy)
        self._num_free = start
        return out

    def alloc_pages(self, k: int) -> torch.Tensor | None:
        """Take ``k`` whole pages; int64 ``[k]`` page ids (page ``p`` = slots ``p*N .. p*N+N-1``), or None."""
        return self._take_pages(k)

    def alloc(self, n: int) -> torch.Tensor | None:
        """``n`` slots from ``ceil(n / page_size)`` fresh pages, in order; int64 ``[n]``, or ``None``.

        The unused tail of the last page belongs to the caller too (free it with any of its slots).
        """
        if self.page_size == 1:
            return self._take_pages(n)
        pages = self._take_pages(-(-n // self.page_size))
        if pages is None:
            return None
        return self.page_slots(pages)[:n]

    def tokens_needed(self, num_kv: int, n: int) -> int:
        """Free slots :meth:`alloc_extend` takes to add ``n`` tokens after ``num_kv`` (whole pages)."""
        room = (-num_kv) % self.page_size
        return -(-max(0, n - room) // self.page_size) * self.page_size

    def alloc_extend(self, num_kv: int, last_slot: int, n: int) -> torch.Tensor | None:
        """Slots of the next ``n`` tokens of a sequence holding ``num_kv`` tokens, the last in ``last_slot``.

        Fills the rest of the last page first (``last_slot + 1 ...``), then takes fresh pages.
        Returns int64 ``[n]``, or ``None`` (nothing taken) if too few pages are free.
        """
        n_ps = self.page_size
        if n_ps == 1:
            return self._take_pages(n)
        room = min((-num_kv) % n_ps, n)
        k = -(-(n - room) // n_ps)
        pages = self._take_pages(k)
        if pages is None:
            return None
        head = torch.arange(last_slot + 1, last_slot + 1 + room, dtype=torch.int64)
        return torch.cat([head, self.page_slots(pages)[: n - room]]) if room else self.page_slots(pages)[:n]

    def page_slots(self, pages: torch.Tensor) -> torch.Tensor:
        """All slots of ``pages`` (int64 ``[k]`` page ids), int64 ``[k * page_size]``, page by page."""
        if self.page_size == 1:
            return pages
        return (pages.unsqueeze(1) * self.page_size
                + torch.arange(self.page_size, dtype=torch.int64)).reshape(-1)

    def pages_of(self, slots: torch.Tensor) -> torch.Tensor:
        """The distinct pages holding ``slots`` (int64 ``[k]``)."""
        if self.page_size == 1:
            return slots.to(torch.int64).flatten()
        return torch.unique(slots.to(torch.int64).flatten() // self.page_size)

    def free(self, indices: torch.Tensor) -> None:
        """Give slots back. ``indices``: int64 ``[k]``, each currently allocated.

        With ``page_size > 1`` every page holding one of ``indices`` is freed whole
        (a request's partial last page goes back with any of its slots).
        """
        if int(indices.numel()) == 0:
            return
        pages = self.pages_of(indices)
        k = int(pages.numel())
        end = self._num_free + k
        if end > self._free.numel():
            raise RuntimeError("freeing more KV slots than were allocated")
        if k > 1:
            pages = torch.sort(pages, descending=True).values  # lowest on top (the class's order rule)
        self._free[self._num_free: end] = pages
        self._num_free = end

    def free_slots(self) -> torch.Tensor:
        """The currently free slot indices (a copy), for invariant checks."""
        return self.page_slots(self._free[: self._num_free]).clone()


def contiguous_run(slots: torch.Tensor) -> int | None:
    """First slot of ``slots`` (int64 ``[L]``) when they are ``s, s + 1, ..., s + L - 1``, else None.

    Reads the tensor on the host (CPU index tensors only; one check per forward, not per layer)."""
    n = int(slots.numel())
    if n == 0 or slots.device.type != "cpu":
        return None
    first = int(slots[0])
    if n == 1 or (int(slots[-1]) - first == n - 1 and bool((slots[1:] - slots[:-1] == 1).all())):
        return first
    return None


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
        if fast_path.ENABLED and k.dtype == self.dtype and v.dtype == self.dtype:
            self.k_buffer[layer].index_copy_(0, loc, k)  # one op each, no __setitem__ index parsing
            self.v_buffer[layer].index_copy_(0, loc, v)
            return
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
