"""The requests queued on kv_aware's targets (routed there, prefill not ended), with their prompts sorted.

:class:`QueuedKeys` is one target's list of those :class:`~.policy.RouteKey` objects, in
insertion order (as :func:`~.policy._shared_queued` walks them).  :class:`SortedPrompts`
holds every target's queued prompts as ids texts (:func:`~..routing_text.ids_text`, one
character per id after a marker) in one sorted list, with the number of leading characters
each shares with the next.  In a sorted list of strings the prefix a probe shares with the
entry ``j`` places away is the smallest of those adjacent figures on the way there and of
the probe's agreement with its own neighbour (for ``a <= b <= c``, ``lcp(a, c) =
min(lcp(a, b), lcp(b, c))``).  So one query (:meth:`SortedPrompts.scan`) gives, for every
target at once, the longest prefix the new prompt shares with one of its queued prompts
(:func:`~.policy._pending_prefix`) and each queued prompt's agreement with it
(:func:`~.policy._shared_queued`) from two string comparisons and a walk over integers.
Before, each target cost two comparisons and a scan of its own keys (each comparison a
binary search of slices, about 2 µs on a 400-id prompt): at 4 workers and 16 requests in
flight the policy spent ~14 µs a request there (benchmarks/kv_policy_cost.py).
The walk stops where the shared figure falls to the query's ``stop``: prompts that share no more
than the least ``cached`` of the queued keys overlap none of their uncached parts, and the policy
passes at most the least cached_tokens of the targets it asks about too, so prompts that share only
a common opening (a system prompt every request starts with) are not walked at all.

A key whose ids text is not one character per id (an id outside ``[0, 0x10FFFF]``) is
kept in its target's list but not in the sorted texts; while a target has any, the policy
scans that target's list (:attr:`QueuedKeys.odd`).  Keys without token ids are neither:
no prefix is compared for them.
"""

from __future__ import annotations

from bisect import bisect_left, insort


def agree_from(a, b, lo: int, hi: int) -> int:
    """The largest ``n`` in ``[lo, hi]`` with ``a[:n] == b[:n]``, given ``a[:lo] == b[:lo]`` and
    ``hi <= min(len(a), len(b))``; ``a``, ``b``: two lists or two strings.  Only the part after ``lo``
    is compared: one slice comparison, then a binary search (O(log(hi - lo)) slices) if they differ."""
    if lo < hi and a[lo] != b[lo]:  # they part at once (e.g. prompts of other prefix groups): no slice
        return lo
    if type(a) is str:  # b's part is sliced, a's compared in place (str.startswith at an offset)
        if a.startswith(b[lo:hi], lo):
            return hi
        while hi - lo > 1:  # a[:lo] agree, a[:hi] do not
            mid = (lo + hi) // 2
            if a.startswith(b[lo:mid], lo):
                lo = mid
            else:
                hi = mid
        return lo
    if a[lo:hi] == b[lo:hi]:
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def one_char_per_id(key) -> str | None:
    """``key``'s ids text when it has one character per id after its marker, else None (also without ids).
    Two such texts compare as their ids do; their slices are copied and compared as memory, where
    lists of ints are compared element by element.  ``key``: a :class:`~.policy.RouteKey`, which keeps
    the answer (its :meth:`~.policy.RouteKey.one_char_text`)."""
    return key.one_char_text()


class QueuedKeys:
    """The queued RouteKeys of one target, iterable in insertion order."""

    __slots__ = ("keys", "odd")

    def __init__(self) -> None:
        self.keys: dict = {}  # key -> None, in insertion order (RouteKeys hash by identity)
        self.odd = 0  # keys with token ids but no one-character-per-id text (not in SortedPrompts)

    def __iter__(self):
        return iter(self.keys)

    def __len__(self) -> int:
        return len(self.keys)

    def append(self, key) -> None:
        """Add ``key`` last (it must not be in already)."""
        self.keys[key] = None
        if key.tokens and key.one_char_text() is None:
            self.odd += 1

    def remove(self, key) -> bool:
        """Take ``key`` (this very object) out; False if it was not in."""
        if self.keys.pop(key, 0) is not None:
            return False
        if key.tokens and key.one_char_text() is None:
            self.odd -= 1
        return True


class SortedPrompts:
    """Every target's queued prompts (one-character-per-id ids texts) in one sorted list; see the
    module docstring.  ``lcps[j]``: the characters ``texts[j]`` and ``texts[j + 1]`` share.
    Adding a prompt costs two string comparisons, each starting past what its neighbours share;
    removing one, none (its neighbours share the smaller of their two figures)."""

    __slots__ = ("texts", "keys", "targets", "lows", "cached", "lcps", "_version", "_probe")

    def __init__(self) -> None:
        self.texts: list[tuple[str, int]] = []  # (ids text, id(key)), sorted; a queued key keeps its id unique
        self.keys: list = []  # the keys of `texts`, in the same order
        self.targets: list = []  # each key's target, in the same order
        self.lows: list[int] = []  # each key's `cached` when it was added, in the same order
        self.cached: list[int] = []  # the same figures, sorted (cached[0]: the least; see scan's `stop`)
        self.lcps: list[int] = []  # len(texts) - 1 adjacent figures
        self._version = 0  # changes with every add / remove
        # the last scan: (text, version, position, characters shared with texts[i - 1], with texts[i]);
        # adding that very text right after (the policy scans a request, then records it) reuses them
        self._probe = None

    def __len__(self) -> int:
        return len(self.texts)

    def add(self, key, target) -> bool:
        """Add ``key``'s prompt, queued on ``target``; False (nothing added) without a one-character-per-id text.
        ``key.cached`` (the start of its uncached part) is read now and must not change until it is removed."""
        text = key.one_char_text()
        if text is None:
            return False
        texts, lcps = self.texts, self.lcps
        entry = (text, id(key))
        j = bisect_left(texts, entry)
        n = len(texts)
        probe = self._probe
        if probe is not None and probe[0] is text and probe[1] == self._version and probe[2] == j:
            if j == n:  # the scan already compared it with its neighbours: last
                if n:
                    lcps.append(probe[3])
            else:
                if j:
                    lcps[j - 1] = probe[3]
                lcps.insert(j, probe[4])
        elif 0 < j < n:  # between two neighbours: it shares with each at least what they share
            floor = lcps[j - 1]
            left, right = texts[j - 1][0], texts[j][0]
            lcps[j - 1] = agree_from(left, text, floor, min(len(left), len(text)))
            lcps.insert(j, agree_from(text, right, floor, min(len(right), len(text))))
        elif j == 0 and n:
            right = texts[0][0]
            lcps.insert(0, agree_from(text, right, 0, min(len(right), len(text))))
        elif n:  # last
            left = texts[n - 1][0]
            lcps.append(agree_from(left, text, 0, min(len(left), len(text))))
        texts.insert(j, entry)
        self.keys.insert(j, key)
        self.targets.insert(j, target)
        self.lows.insert(j, key.cached)
        insort(self.cached, key.cached)
        self._version += 1
        return True

    def remove(self, key) -> bool:
        """Take ``key``'s prompt out; False if it was not in."""
        text = key.one_char_text()
        if text is None:
            return False
        texts = self.texts
        j = bisect_left(texts, (text, id(key)))
        if j == len(texts) or self.keys[j] is not key:
            return False
        n = len(texts)
        cached = self.cached
        del cached[bisect_left(cached, self.lows[j])]
        del texts[j], self.keys[j], self.targets[j], self.lows[j]
        self._version += 1
        lcps = self.lcps
        if 0 < j < n - 1:  # its two neighbours become adjacent
            if lcps[j] < lcps[j - 1]:
                lcps[j - 1] = lcps[j]
            del lcps[j]
        elif n > 1:
            del lcps[0 if j == 0 else j - 1]
        return True

    def _walk(self, out: dict, a: int, j: int, step: int, stop: int) -> None:
        """From entry ``j``, which shares ``a`` ids with the probe, outwards by ``step`` (-1 or 1) while the
        shared figure stays above ``stop``, adding each entry to ``out`` (see :meth:`scan`)."""
        targets, lows, lcps = self.targets, self.lows, self.lcps
        end = -1 if step < 0 else len(targets)
        while a > stop:
            t = targets[j]
            got = out.get(t)
            if got is None:
                got = out[t] = [a, []]
            elif a > got[0]:
                got[0] = a
            lo = lows[j]
            if a > lo:
                got[1].append((a, lo))
            nxt = j + step
            if nxt == end:
                break
            b = lcps[j if step > 0 else nxt] - 1  # what entries j and nxt share
            j = nxt
            if b < a:
                a = b

    def scan(self, text: str, stop: int = 0) -> dict:
        """For each target with a queued prompt sharing more than ``stop`` token ids with ``text`` (a
        one-character-per-id ids text): ``(longest, pairs)``, ``longest`` the most leading ids ``text``
        shares with one of its queued prompts, ``pairs`` the ``(shared ids, k.cached)`` of each of its
        queued keys ``k`` that shares more than its own ``cached`` (the others cannot overlap its
        uncached part).  Cost: two bounded string comparisons and a step per prompt that shares more
        than ``stop`` ids.

        With ``stop`` > 0 a target none of whose queued prompts shares more than ``stop`` ids with
        ``text`` is left out (its ``longest`` is then at most ``stop``), and so are the prompts of the
        targets in ``out`` that share no more than ``stop`` ids: at ``stop <= self.cached[0]`` (the least
        ``cached`` of the queued keys) none of those could have been in a ``pairs`` list, so every
        ``pairs`` list is whole and every ``longest`` in ``out`` exact.  (In a sorted list the
        shared figure only falls with the distance from ``text``'s place, so the walk stops there.)"""
        texts, lcps = self.texts, self.lcps
        n = len(texts)
        out: dict = {}
        if not n:
            return out
        i = bisect_left(texts, (text,))
        floor = lcps[i - 1] if 0 < i < n else 1  # both neighbours share this much; every text starts with the marker
        tl = len(text)
        left = right = 0
        if i > 0:  # leftwards from the predecessor
            other = texts[i - 1][0]
            hi = min(tl, len(other))
            left = agree_from(text, other, min(floor, hi), hi)
            self._walk(out, left - 1, i - 1, -1, stop)  # in ids: the marker is not one
        if i < n:  # rightwards from the successor
            other = texts[i][0]
            hi = min(tl, len(other))
            right = agree_from(text, other, min(floor, hi), hi)
            self._walk(out, right - 1, i, 1, stop)
        self._probe = (text, self._version, i, left, right)
        return out
