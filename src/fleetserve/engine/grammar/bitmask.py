"""The allowed-token bitmask and its application to logits.

Layout (llguidance's and xgrammar's): int32 ``[R, ceil(V / 32)]``; token ``t``
is allowed in row ``r`` when bit ``t % 32`` of word ``t // 32`` is set
(least significant bit first).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch



def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """int32 ``[rows, ceil(vocab_size / 32)]`` with every token allowed (all bits set)."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def _banned_bits(bitmask: torch.Tensor) -> np.ndarray:
    """bool ``[R, 32 W]``: True where the token is *not* allowed.

    Little-endian int32 words make token ``t`` bit ``t % 8`` of byte ``t // 8``, which is
    numpy's ``unpackbits(bitorder="little")`` order.
    """
    as_bytes = np.ascontiguousarray(bitmask.numpy()).view(np.uint8)
    return np.unpackbits(np.invert(as_bytes), axis=1, bitorder="little").view(np.bool_)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool ``[R, vocab_size]``: True where the token is allowed (``vocab_size <= 32 * W``)."""
    return torch.from_numpy(~_banned_bits(bitmask)[:, :vocab_size])


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """Set the disallowed logits of ``rows`` to ``-inf``, in place.

    numpy does the work (``unpackbits`` and a masked ``copyto``): on this project's
    CPU builds torch's ``masked_fill_`` over ``[32, 49152]`` took ~10x longer.

    Args:
        logits: float32 contiguous CPU ``[B, V]`` (not requiring grad).
        bitmask: int32 ``[len(rows), W]``; row ``j`` is for ``logits[rows[j]]``. Tokens at
            or past ``32 * W`` (a model vocabulary padded past the mask) are disallowed.
        rows: which logit rows the mask rows belong to (other rows are untouched).
    """
    if not rows:
        return
    vocab = logits.shape[-1]
    covered = min(vocab, 32 * bitmask.shape[1])
    banned = _banned_bits(bitmask)[:, :covered]
    out = logits.numpy()
    if list(rows) == list(range(out.shape[0])):
        np.copyto(out[:, :covered], -np.inf, where=banned)
        out[:, covered:] = -np.inf
        return
    idx = np.asarray(rows, dtype=np.int64)
    sub = out[idx, :covered]
    np.copyto(sub, -np.inf, where=banned)
    out[idx, :covered] = sub
    out[idx, covered:] = -np.inf
