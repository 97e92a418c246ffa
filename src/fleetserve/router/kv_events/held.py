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
parts count in whole pages, as an engine shares them.  It is recomputed only when the running set
changes and only when asked (a target whose engine figure is above the router's).

Requests without token ids (routed on text) never share as far as the router can tell: each counts
whole.  A running request sent after the snapshot's figures were taken is still in the union (rare:
its prefill must have ended in the meantime).  A non-streamed request shows no first byte: it
stays "waiting" until its answer ends or an engine snapshot's ``num_waiting_reqs`` shows it admitted
(:meth:`.policy.KvAwarePolicy.engine_snapshot`, at least ``KNOWN_AFTER_S`` after it was sent); until
then, with such requests on a shared prefix, the figure errs low.
"""

from __future__ import annotations

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


class HeldPrefixes:
    """One target's in-flight requests with cached tokens, split as the engine counts them.

    ``waiting``: the keys whose prefill has not ended, in the order sent, and ``waiting_tokens``
    their summed ``cached``; ``running``: the others (:func:`union_of_prefixes` over them, memoised).
    """

    __slots__ = ("waiting", "waiting_tokens", "running", "page", "_union")

    def __init__(self, page: int = 1) -> None:
        self.waiting: dict = {}  # key -> None, in the order sent
        self.waiting_tokens = 0
        self.running: dict = {}  # key -> None
        self.page = page
        self._union = 0  # None: to recompute

    def __bool__(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, key) -> None:
        """A request sent with ``key.cached > 0``; waiting while ``key.queued`` (its prefill not ended)."""
        if key.queued > 0:
            self.waiting[key] = None
            self.waiting_tokens += key.cached
        else:
            self.running[key] = None
            self._union = None

    def prefilled(self, key) -> None:
        """``key``'s prefill ended: from now on the engine holds its cached pages with the running batch."""
        if self.waiting.pop(key, 0) is None:
            self.waiting_tokens -= key.cached
            self.running[key] = None
            self._union = None

    def remove(self, key, freed: bool = True) -> int:
        """``key``'s answer ended.  Returns the tokens of its cached prefix that no other running
        request shares (what the engine frees of it), or its ``cached`` when it was waiting; 0 if not
        here.  ``freed=False``: the answer is not needed (returns 0 for a running key; the union is
        then recomputed only when next asked)."""
        if self.waiting.pop(key, 0) is None:
            self.waiting_tokens -= key.cached
            return key.cached
        if key not in self.running:
            return 0
        before = self.running_union() if freed else 0
        del self.running[key]
        self._union = None
        if not freed:
            return 0
        return before - (self.running_union() if self.running else 0)

    def running_union(self) -> int:
        if self._union is None:
            self._union = union_of_prefixes(self.running, self.page)
        return self._union

    def counted(self, counts_from: float | None) -> int:
        """The cached tokens of these requests that an engine snapshot counting the requests sent
        before ``counts_from`` (monotonic seconds; None: no snapshot, 0) holds: the running union plus
        the waiting keys sent before then."""
        if counts_from is None:
            return 0
        total = self.waiting_tokens
        for k in reversed(self.waiting):
            if k.charged[2] < counts_from:
                break
            total -= k.cached
        return total + (self.running_union() if self.running else 0)
