"""The cached prompt prefixes of kv_aware's in-flight requests on one target, as its engine counts them.

An engine's ``/v1/loads`` ``num_total_tokens`` is ``num_used_tokens`` (KV slots held by its running
requests) plus the full lengths of its waiting requests.  The router's own load counts only what
each of its requests adds (uncached prompt + decode budget), so before the two figures are compared
the policy takes off the cached prefixes of its requests that the engine's figure counts
(:func:`.policy._held_cached`).  How the engine counts them depends on the request's state:

* a request still waiting (here: prefill not ended, no first answer byte yet) is counted whole,
  its cached prefix included, once per request;
* a running request holds its cached pages in the radix cache, and requests that share a prefix
  hold those pages **once** (SGLang's and our ``num_used_tokens`` are the pool's used slots less the
  evictable ones).  So for running requests the figure to take off is the size of the *union* of
  their cached prefixes, not their sum: with 16 conversations on a 2,000-token system prompt the sum
  over-counts by 30,000 tokens and the engine's figure would read as zero.

The union of prefixes ``s_i[:c_i]`` is ``sum(c_i)`` less, in sorted order of the truncated
prefixes, the prefix each shares with the one before it (the node count of their trie); shared
parts count in whole pages, as an engine shares them.  :class:`HeldPrefixes` keeps that sum up to date
as requests start and end running, comparing only a changed prefix with its neighbours in the order.

Requests without token ids (routed on text) never share as far as the router can tell: each counts
whole.  A running request sent after the snapshot's figures were taken is still in the union (rare:
its prefill must have ended in the meantime).  A non-streamed request shows no first byte: it
stays "waiting" until its answer ends or an engine snapshot's ``num_waiting_reqs`` shows it admitted
(:meth:`.policy.KvAwarePolicy.engine_snapshot`, at least ``KNOWN_AFTER_S`` after it was sent); until
then, with such requests on a shared prefix, the figure errs low.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right

from .pending import agree_from


def union_of_prefixes(keys, page: int = 1) -> int:
    """Tokens in the union of ``key.tokens[:key.cached]`` over ``keys`` (RouteKeys with ``cached > 0``).

    ``page``: the engine's page size; a shared part counts in whole pages (an engine shares no partial
    page).  Keys without token ids count whole.  O(n log n) slice comparisons for n keys."""
    total = 0
    texts = []
    lists = []
    loose = 0  # cached tokens of keys without ids: never shared
    for k in keys:
        c = k.cached
        total += c
        if not k.tokens:
            loose += c
            continue
        t = k.one_char_text()
        if t is None:
            lists.append(k.tokens[:c])
        else:
            texts.append(t[1:c + 1])  # after the marker: one character per id
    # (a key whose ids do not fit one character each is compared with the other such keys only: rare)
    shared = 0
    for group in (texts, lists):
        if len(group) < 2:
            continue
        group.sort()
        prev = group[0]
        for cur in group[1:]:
            n = agree_from(prev, cur, 0, min(len(prev), len(cur)))
            shared += n - n % page if page > 1 else n
            prev = cur
    return total - shared


def _shared(a, b, page: int) -> int:
    """Tokens two prefixes (strings or lists, or None at an end of the order) share, in whole pages."""
    if a is None or b is None:
        return 0
    n = agree_from(a, b, 0, min(len(a), len(b)))
    return n - n % page if page > 1 else n


class HeldPrefixes:
    """One target's in-flight requests with cached tokens, split as the engine counts them.

    ``waiting``: the keys whose prefill has not ended, in the order sent, and ``waiting_tokens``
    their summed ``cached``; ``running``: the others (key -> its ``cached``), with the size of the
    union of their cached prefixes (:func:`union_of_prefixes`) kept up to date as keys come and go:
    their truncated prefixes stay sorted, and the union is their summed length less the
    (page-rounded) prefix each shares with the one before it, so a key added or removed changes only
    the pairs around its place: O(log n) slice comparisons and one list insert or delete per change,
    where recomputing the union costs O(n log n) (at 120 running requests on 4 targets, about 75 µs
    more CPU per routing decision; docs/benchmarks.md ``router-kv-held-incremental``).

    The sorted order is built only when the union is first asked for (:meth:`running_union`,
    :meth:`counted`, or :meth:`remove` of a running key with ``freed``): the policy asks only for a
    target whose engine reports ``/v1/loads`` figures, so a target without them (a vLLM worker, the
    overhead stick's fake workers) keeps two dicts and a sum per request and sorts nothing.  From then
    on it is kept up to date key by key.
    """

    __slots__ = ("waiting", "waiting_tokens", "running", "page", "_sum", "_shared", "_texts", "_lists",
                 "_indexed")

    def __init__(self, page: int = 1) -> None:
        self.waiting: dict = {}  # key -> None, in the order sent
        self.waiting_tokens = 0
        self.running: dict = {}  # key -> its cached tokens when it started running
        self.page = page
        self._sum = 0  # summed cached tokens of the running keys
        self._indexed = False  # _texts, _lists and _shared are built (_index) and kept up to date
        self._shared = 0  # summed page-rounded prefixes of neighbours in _texts and in _lists
        self._texts: list = []  # the running keys' cached prefixes as one-character-per-id texts, sorted
        self._lists: list = []  # those whose ids do not fit one character each, as lists, sorted (rare)

    def __bool__(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, key) -> None:
        """A request sent with ``key.cached > 0``; waiting while ``key.queued`` (its prefill not ended)."""
        if key.queued > 0:
            self.waiting[key] = None
            self.waiting_tokens += key.cached
        else:
            self._run(key)

    def prefilled(self, key) -> None:
        """``key``'s prefill ended: from now on the engine holds its cached pages with the running batch."""
        if self.waiting.pop(key, 0) is None:
            self.waiting_tokens -= key.cached
            self._run(key)

    def remove(self, key, freed: bool = True) -> int:
        """``key``'s answer ended.  Returns the tokens of its cached prefix that no other running
        request shares (what the engine frees of it), or its ``cached`` when it was waiting; 0 if not
        here.  ``freed=False``: the answer is not needed (returns 0 for a running key)."""
        if self.waiting.pop(key, 0) is None:
            self.waiting_tokens -= key.cached
            return key.cached
        c = self.running.get(key)
        if c is None:
            return 0
        if not self._indexed:
            if not freed:
                del self.running[key]
                self._sum -= c
                return 0
            self._index()
        del self.running[key]
        self._sum -= c
        entry = _entry(key, c)
        if entry is None:
            return c if freed else 0
        group = self._texts if isinstance(entry, str) else self._lists
        i = bisect_left(group, entry)  # group[i] == entry (an equal one: equal entries are interchangeable)
        before = group[i - 1] if i > 0 else None
        after = group[i + 1] if i + 1 < len(group) else None
        page = self.page
        kept = _shared(before, entry, page) + _shared(entry, after, page) - _shared(before, after, page)
        del group[i]
        self._shared -= kept
        return c - kept if freed else 0

    def _run(self, key) -> None:
        c = key.cached
        self.running[key] = c
        self._sum += c
        if self._indexed:
            self._insert(_entry(key, c))

    def _insert(self, entry) -> None:
        if entry is None:
            return
        group = self._texts if isinstance(entry, str) else self._lists
        i = bisect_right(group, entry)
        before = group[i - 1] if i > 0 else None
        after = group[i] if i < len(group) else None
        page = self.page
        self._shared += _shared(before, entry, page) + _shared(entry, after, page) - _shared(before, after, page)
        group.insert(i, entry)

    def _index(self) -> None:
        """Build the sorted prefixes of the running keys and their shared sum (O(n log n) once)."""
        texts, lists = [], []
        for k, c in self.running.items():
            entry = _entry(k, c)
            if entry is not None:
                (texts if isinstance(entry, str) else lists).append(entry)
        shared = 0
        page = self.page
        for group in (texts, lists):
            group.sort()
            for i in range(1, len(group)):
                shared += _shared(group[i - 1], group[i], page)
        self._texts, self._lists, self._shared, self._indexed = texts, lists, shared, True

    def running_union(self) -> int:
        """Tokens in the union of the running keys' cached prefixes (:func:`union_of_prefixes`)."""
        if not self._indexed:
            self._index()
        return self._sum - self._shared

    def pinned(self) -> int:
        """Tokens in the union of every in-flight key's cached prefix, waiting and running alike: what
        the pool must keep for all of them to find their prefixes (the pool term, :func:`.policy._overflow`).
        With waiting keys, O(n log n) over all keys (:func:`union_of_prefixes`); else :meth:`running_union`."""
        if not self.waiting:
            return self.running_union()
        return union_of_prefixes([*self.waiting, *self.running], self.page)

    def counted(self, counts_from: float | None, waiting: bool = True) -> int:
        """The cached tokens of these requests that an engine snapshot counting the requests sent
        before ``counts_from`` (monotonic seconds; None: no snapshot, 0) holds: the running union plus
        the waiting keys sent before then (``waiting=False``: the union alone, for a figure that counts
        no waiting request, vLLM's)."""
        if counts_from is None:
            return 0
        if not waiting:
            return self.running_union()
        total = self.waiting_tokens
        for k in reversed(self.waiting):
            if k.charged[2] < counts_from:
                break
            total -= k.cached
        return total + self.running_union()


def _entry(key, c: int):
    """``key``'s first ``c`` ids as the running order keeps them: its ids text after the marker (one
    character per id), or a list where an id does not fit one character; None without ids."""
    if not key.tokens:
        return None
    t = key.one_char_text()
    return key.tokens[:c] if t is None else t[1:c + 1]
