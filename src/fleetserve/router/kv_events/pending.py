"""The requests queued on one kv_aware target (routed there, prefill not ended), with their prompts sorted.

:class:`QueuedKeys` is the list of those :class:`~.policy.RouteKey` objects (insertion
order, as :func:`~.policy._shared_queued` walks them) plus a sorted list of their ids
texts (:func:`~..routing_text.ids_text`, one character per id after a marker).  The
longest prefix a new prompt shares with any of them (:func:`~.policy._pending_prefix`)
is then found from two neighbours instead of a scan: in a sorted list of strings the one
sharing the longest prefix with a probe is the probe's predecessor or successor (for
``a <= b <= c``, ``lcp(a, c) = min(lcp(a, b), lcp(b, c))``).  Cost per query: a binary
search of the list, two slice comparisons and at most two binary searches of a prompt;
at c=128 on 4 workers (about 32 queued per target) that replaced a loop of 32 key
comparisons per target (docs/benchmarks.md, router-overhead-kv).

A key whose ids text is not one character per id (an id outside ``[0, 0x10FFFF]``) is
kept in the list but not in the sorted texts; while the target has any, the policy scans
(:attr:`QueuedKeys.odd`).  Keys without token ids are neither: no prefix is compared for
them.
"""

from __future__ import annotations

from bisect import bisect_left, insort


def agree_from(a, b, lo: int, hi: int) -> int:
    """The largest ``n`` in ``[lo, hi]`` with ``a[:n] == b[:n]``, given ``a[:lo] == b[:lo]`` and
    ``hi <= min(len(a), len(b))``; ``a``, ``b``: two lists or two strings.  Only the part after ``lo``
    is compared: one slice comparison, then a binary search (O(log(hi - lo)) slices) if they differ."""
    if lo < hi and a[lo] != b[lo]:  # they part at once (e.g. prompts of other prefix groups): no slice
        return lo
    if a[lo:hi] == b[lo:hi]:
        return hi
    while hi - lo > 1:  # a[:lo] agree, a[:hi] do not
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def one_char_per_id(key) -> str | None:
    """``key``'s ids text when it has one character per id after its marker, else None (also without ids).
    Two such texts compare as their ids do; their slices are copied and compared as memory, where
    lists of ints are compared element by element."""
    tokens = key.tokens
    if not tokens:
        return None
    text = key.tree_text()
    return text if len(text) == len(tokens) + 1 else None


class QueuedKeys:
    """The queued RouteKeys of one target: iterable in insertion order, plus their sorted ids texts."""

    __slots__ = ("keys", "texts", "odd")

    def __init__(self) -> None:
        self.keys: list = []
        self.texts: list[tuple[str, int]] = []  # (ids text, id(key)), sorted; a key in `keys` keeps its id unique
        self.odd = 0  # keys with token ids but no one-character-per-id text

    def __iter__(self):
        return iter(self.keys)

    def __len__(self) -> int:
        return len(self.keys)

    def append(self, key) -> None:
        self.keys.append(key)
        text = one_char_per_id(key)
        if text is not None:
            insort(self.texts, (text, id(key)))
        elif key.tokens:
            self.odd += 1

    def remove(self, key) -> bool:
        """Take ``key`` (this very object) out; False if it was not in."""
        keys = self.keys
        for i, k in enumerate(keys):
            if k is key:
                del keys[i]
                break
        else:
            return False
        text = one_char_per_id(key)
        if text is not None:
            entry = (text, id(key))
            j = bisect_left(self.texts, entry)
            if j < len(self.texts) and self.texts[j] == entry:
                del self.texts[j]
        elif key.tokens:
            self.odd -= 1
        return True

    def longest_prefix(self, text: str) -> int:
        """The most leading token ids ``text`` (a one-character-per-id ids text) shares with one queued key."""
        texts = self.texts
        i = bisect_left(texts, (text,))
        best = 0
        for j in (i - 1, i):
            if 0 <= j < len(texts):
                other = texts[j][0]
                n = agree_from(text, other, 1, min(len(text), len(other))) - 1  # both start with the marker
                if n > best:
                    best = n
        return best
