"""Session affinity (``--sticky-sessions``): a session's requests go to the worker it used last.

A request carries a *session key* in the first of the ``--routing-key-headers``
(default ``x-smg-routing-key``, as smg) that holds a valid value, or, with
``--routing-key-from-user`` (ours), in the OpenAI ``user`` field of its body.
A valid value is non-empty, UTF-8 and at most 128 bytes (smg's rule); others are
skipped.  As in smg, a header key loses one trailing retry suffix ``_r<digits>``
and then one turn suffix ``_t<digits>`` (``conv_t2_r1`` -> ``conv``), so the turns
and retries of one conversation share a key.

Precedence (the docs' "Session affinity"): a known session whose worker is
available (healthy, not removed, circuit not open) and within the load bound
(:func:`~.policies.over_balance` against the least-loaded available worker, the
test cache_aware applies to a matched worker) gets that worker; the routing tree
then learns the text under it too.  Otherwise -- a new key, or its worker gone or
too busy -- the policy decides (cache_aware: the prefix, then the load) and the
session moves to the worker chosen.  Requests without a key are the policy's.

Memory is bounded: at most ``--sticky-max-sessions`` (ours) sessions, the least
recently used one dropped first; a session unused for ``--max-idle-secs`` (smg's
name, alias ``--sticky-key-idle-secs``; 0 = never) is forgotten.  Both are O(1)
per request (one ordered dict in last-use order).  A removed worker's sessions
are forgotten at once (:meth:`StickySessions.forget_worker`).
"""

from __future__ import annotations

import re
import time
from collections import OrderedDict

from .policies import over_balance
from .workers import Worker

DEFAULT_ROUTING_KEY_HEADERS = ("x-smg-routing-key",)  # smg's default
MAX_KEY_BYTES = 128  # smg's limit on a routing key
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # a header field name (RFC 9110 5.1: a token)
_RETRY_SUFFIX = re.compile(r"_r[0-9]+\Z")
_TURN_SUFFIX = re.compile(r"_t[0-9]+\Z")
_USER = "\x00user:"  # user-field keys live apart from header keys (a header value cannot hold NUL)


def check_header_name(name: str) -> str:
    """``name`` lower-cased; ``ValueError`` if it is not a valid HTTP header name."""
    if not _TOKEN.fullmatch(name):
        raise ValueError(f"--routing-key-headers: {name!r} is not a valid header name")
    return name.lower()


def strip_lineage(key: str) -> str:
    """Drop one trailing ``_r<digits>``, then one ``_t<digits>`` (smg's rule); all of ``key`` if nothing is left."""
    base = _TURN_SUFFIX.sub("", _RETRY_SUFFIX.sub("", key, count=1), count=1)
    return base or key


def _valid(value) -> bool:
    return isinstance(value, str) and 0 < len(value.encode("utf-8", "surrogatepass")) <= MAX_KEY_BYTES


class StickySessions:
    """The session table and the sticky decision.  ``clock`` gives seconds (monotonic).

    Counters for metrics: ``hits`` (the session's worker took the request), ``new``
    (an unknown key: the policy decided), ``moved`` (the session's worker was gone or
    too busy: the policy decided and the session moved).
    """

    def __init__(self, headers=DEFAULT_ROUTING_KEY_HEADERS, use_user: bool = False, max_sessions: int = 100_000,
                 idle_s: float = 14400.0, abs_threshold: float = 64, rel_threshold: float = 1.5,
                 clock=time.monotonic) -> None:
        if max_sessions < 1:
            raise ValueError("--sticky-max-sessions must be >= 1")
        if idle_s < 0:
            raise ValueError("--max-idle-secs must be >= 0")
        self.headers = tuple(check_header_name(h) for h in headers)
        self.use_user = use_user
        self.max_sessions = max_sessions
        self.idle_s = idle_s
        self.abs_threshold = abs_threshold
        self.rel_threshold = rel_threshold
        self.clock = clock
        self._table: OrderedDict[str, tuple[str, float]] = OrderedDict()  # key -> (worker url, last use)
        self.hits = self.new = self.moved = 0

    @classmethod
    def from_config(cls, cfg) -> "StickySessions":
        return cls(cfg.routing_key_headers, cfg.routing_key_from_user, cfg.sticky_max_sessions,
                   cfg.sticky_idle_secs, cfg.balance_abs_threshold, cfg.balance_rel_threshold)

    def __len__(self) -> int:
        return len(self._table)

    # -- keys
    def key(self, headers: dict[str, str], body: dict) -> str | None:
        """The request's session key, or None.  ``headers``: lower-case name -> value (latin-1 text)."""
        for name in self.headers:
            v = headers.get(name)
            if v is None:
                continue
            try:
                v = v.encode("latin-1").decode("utf-8")
            except UnicodeError:
                continue
            if _valid(v):
                return strip_lineage(v)
        if self.use_user:
            user = body.get("user")
            if _valid(user):
                return _USER + user
        return None

    # -- the table
    def lookup(self, key: str) -> str | None:
        """The url of the session's last worker, or None (unknown, or idle past the limit: then forgotten)."""
        entry = self._table.get(key)
        if entry is None:
            return None
        if self.idle_s and self.clock() - entry[1] > self.idle_s:
            del self._table[key]
            return None
        return entry[0]

    def remember(self, key: str, url: str) -> None:
        """The session's request went to ``url`` now: pin it there, drop the expired and the excess."""
        table = self._table
        now = self.clock()
        table[key] = (url, now)
        table.move_to_end(key)
        if self.idle_s:
            cutoff = now - self.idle_s
            while table:
                oldest = next(iter(table.values()))
                if oldest[1] >= cutoff:
                    break
                table.popitem(last=False)
        while len(table) > self.max_sessions:
            table.popitem(last=False)

    def forget_worker(self, url: str) -> int:
        """Forget every session pinned to ``url`` (a removed worker); returns how many."""
        gone = [k for k, (u, _) in self._table.items() if u == url]
        for k in gone:
            del self._table[k]
        return len(gone)

    # -- the decision
    def select(self, key: str, workers: list[Worker], text: str, policy) -> Worker | None:
        """The session's worker if it is among ``workers`` (the available ones) and within the load bound, else None.

        On a hit the text is inserted under that worker in the policy's routing tree
        (cache_aware), so prefix matching knows where the conversation lives; kv_aware's
        key (not text) is left to its ``pin``, which the proxy calls.
        """
        url = self.lookup(key)
        if url is None:
            self.new += 1
            return None
        lo = min(w.load for w in workers) if workers else 0
        for w in workers:
            if w.url == url:
                if over_balance(w.load, lo, self.abs_threshold, self.rel_threshold):
                    break
                self.hits += 1
                tree = getattr(policy, "tree", None)
                if tree is not None and isinstance(text, str) and text:  # kv_aware records its own (pin)
                    policy.last_claim = (text, url, tree.insert(text, url))  # see CacheAwarePolicy.last_claim
                return w
        self.moved += 1
        return None
