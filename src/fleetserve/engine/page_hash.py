"""SGLang's chained SHA-256 page hash: the block ids of KV events.

A page of ``page_size`` token ids hashes as ``sha256(prior_digest || t_0 || t_1 ...)``
where each token id is 4 bytes, unsigned little-endian, and ``prior_digest`` is
the 32-byte digest of the page before it (nothing for the first page of a
sequence). The id an event carries is the digest's first 8 bytes read as a
big-endian *signed* 64-bit integer, i.e. SGLang's
``hash_str_to_int64(hexdigest)`` (first 16 hex characters, two's complement).

Source: SGLang ``python/sglang/srt/mem_cache/utils.py`` (``get_hash_str``,
``hash_str_to_int64``) and ``radix_cache.py`` ``_record_store_event``, which
chain a node's first page on its parent's last page hash. Our code is our own.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence


def page_digests(token_ids: Sequence[int], page_size: int, prior: bytes | None = None) -> list[bytes]:
    """Chained digests of the pages of ``token_ids``.

    Args:
        token_ids: ints in ``[0, 2**32)``; a trailing partial page is hashed as a
            (short) page, as SGLang does, but the radix cache only passes whole pages.
        page_size: tokens per page (>= 1).
        prior: 32-byte digest of the page before ``token_ids[0]``, or ``None`` at the root.

    Returns:
        One 32-byte SHA-256 digest per page, ``ceil(len(token_ids) / page_size)`` of them.

    Raises:
        ValueError: a token id outside ``[0, 2**32)`` (or not an int); the message names it.
    """
    out: list[bytes] = []
    n = len(token_ids)
    for start in range(0, n, page_size):
        page = token_ids[start: start + page_size]
        h = hashlib.sha256(prior) if prior else hashlib.sha256()
        try:
            h.update(struct.pack(f"<{len(page)}I", *page))
        except struct.error:
            bad = next((t for t in page if not isinstance(t, int) or not 0 <= t < 1 << 32), page)
            raise ValueError(f"token id {bad!r} cannot be hashed: page hashes take ids in [0, 2**32)") from None
        prior = h.digest()
        out.append(prior)
    return out


def digest_to_int64(digest: bytes) -> int:
    """The event block id of a page digest: first 8 bytes, big-endian, signed (int64 range)."""
    return int.from_bytes(digest[:8], "big", signed=True)


def hash_str_to_int64(hash_str: str) -> int:
    """SGLang's ``hash_str_to_int64``: first 16 hex characters of a hex digest as a signed int64.

    Raises:
        ValueError: fewer than 16 characters, or not hex.
    """
    if len(hash_str) < 16:
        raise ValueError(f"hash string too short: {hash_str!r}")
    return int.from_bytes(bytes.fromhex(hash_str[:16]), "big", signed=True)


def page_hashes(token_ids: Sequence[int], page_size: int, prior: bytes | None = None) -> list[int]:
    """:func:`page_digests` mapped through :func:`digest_to_int64` (the ids KV events carry)."""
    return [digest_to_int64(d) for d in page_digests(token_ids, page_size, prior)]
