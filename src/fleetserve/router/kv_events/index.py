"""The router's index of the blocks each (worker, DP rank) holds, built from its KV events.

A *target* is ``(worker_url, dp_rank)``.  A *block key* is the router's own
chained hash of one full block of token ids::

    key_0 = hash((0, tuple(tokens[0:B])))
    key_i = hash((key_{i-1}, tuple(tokens[i*B:(i+1)*B])))

with ``B`` the block size the engine reports in its ``BlockStored`` events, so
a block's key depends on every token before it (the scheme of vLLM's prefix
caching and of NVIDIA Dynamo's KV router; our hash is CPython's tuple hash,
xxHash-based and deterministic for ints, so no PYTHONHASHSEED dependence).
The engine's own block hash is kept only to apply its ``BlockRemoved`` events
and to find a stored block's parent.

Bound: at most ``max_blocks`` (target, block) entries in all.  Beyond it the
least recently stored entry is dropped (an engine evicts its LRU blocks too),
so memory is O(max_blocks) whatever the publishers send.

Speculative entries (:meth:`BlockIndex.add_speculative`): a request routed to
a target counts as cached there for ``ttl`` seconds, until its own events
arrive.  They are kept apart, bounded by the same ``max_blocks``.

Thread safety: every public method takes ``self.lock``; the subscriber threads
apply events while the event loop matches.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque

from .decode import AllBlocksCleared, BlockRemoved, BlockStored

Target = tuple  # (worker_url: str, dp_rank: int)


def block_keys(tokens: list[int], block_size: int, limit: int | None = None) -> list[int]:
    """Chained keys of the full blocks of ``tokens`` (a trailing partial block has none)."""
    n = len(tokens) // block_size
    if limit is not None:
        n = min(n, limit)
    keys = []
    k = 0
    for i in range(0, n * block_size, block_size):
        k = hash((k, tuple(tokens[i:i + block_size])))
        keys.append(k)
    return keys


class BlockIndex:
    """Block key -> targets holding it; see the module docstring."""

    def __init__(self, max_blocks: int = 1 << 20) -> None:
        if max_blocks < 1:
            raise ValueError("max_blocks must be >= 1")
        self.max_blocks = max_blocks
        self.lock = threading.Lock()
        # key -> the targets holding it (from events), as a tuple: a few targets at most, and a tuple of
        # targets leaves the cyclic GC after one pass, where a set stays tracked: with 2^20 blocks as sets
        # a full collection took ~90 ms, every thread (the event loop too) stopped
        self._owners: dict[int, tuple] = {}
        self._blocks: dict[Target, dict] = {}  # target -> engine hash -> key
        self._lru: OrderedDict = OrderedDict()  # (target, engine hash) -> None, oldest first
        self.block_size: dict[Target, int] = {}  # from the target's BlockStored events
        self._spec: dict[int, dict] = {}  # key -> target -> expiry (monotonic s)
        self._spec_q: deque = deque()  # (expiry, key, target), in expiry order for one TTL
        self.orphans = 0  # stored blocks whose parent was unknown (skipped)
        self.skipped = 0  # stored blocks of a LoRA adapter or a non-GPU medium (skipped)
        self.evicted = 0  # entries dropped by the bound

    # ------------------------------------------------------------ events
    def apply(self, target: Target, event) -> None:
        """Apply one decoded event of ``target``."""
        with self.lock:
            if type(event) is BlockStored:
                self._store(target, event)
            elif type(event) is BlockRemoved:
                blocks = self._blocks.get(target)
                if blocks:
                    for h in event.block_hashes:
                        self._forget(target, blocks, h)
            elif type(event) is AllBlocksCleared:
                self._drop(target)

    def _store(self, target: Target, ev: BlockStored) -> None:
        if ev.lora or (ev.medium is not None and ev.medium != "GPU"):
            self.skipped += len(ev.block_hashes)
            return
        blocks = self._blocks.setdefault(target, {})
        if ev.parent is None:
            k = 0
        else:
            k = blocks.get(ev.parent)
            if k is None:
                self.orphans += len(ev.block_hashes)
                return
        bs = ev.block_size
        self.block_size[target] = bs
        toks = ev.token_ids
        owners, lru = self._owners, self._lru
        for i, h in enumerate(ev.block_hashes):
            k = hash((k, tuple(toks[i * bs:(i + 1) * bs])))
            old = blocks.get(h)
            if old is not None and old != k:  # the engine reused a hash for other tokens
                self._forget(target, blocks, h)
            blocks[h] = k
            s = owners.get(k)
            if s is None:
                owners[k] = (target,)
            elif target not in s:
                owners[k] = s + (target,)
            lru[(target, h)] = None
            lru.move_to_end((target, h))
        while len(lru) > self.max_blocks:
            (t, h), _ = lru.popitem(last=False)
            self.evicted += 1
            self._forget(t, self._blocks[t], h, in_lru=False)

    def _forget(self, target: Target, blocks: dict, h, in_lru: bool = True) -> None:
        k = blocks.pop(h, None)
        if k is None:
            return
        if in_lru:
            self._lru.pop((target, h), None)
        self._disown(k, target)

    def _disown(self, k: int, target: Target) -> None:
        owners = self._owners
        s = owners.get(k)
        if s is not None and target in s:
            rest = tuple(t for t in s if t != target)
            if rest:
                owners[k] = rest
            else:
                del owners[k]

    def _drop(self, target: Target) -> None:
        blocks = self._blocks.pop(target, None)
        if not blocks:
            return
        for h, k in blocks.items():
            self._lru.pop((target, h), None)
            self._disown(k, target)

    def drop_target(self, target: Target) -> None:
        """Forget every block of ``target`` (its stream is no longer trusted, or it was removed)."""
        with self.lock:
            self._drop(target)
            self.block_size.pop(target, None)

    def drop_cached(self, url: str) -> None:
        """Forget every block, and every speculative entry, of every DP rank of ``url``; its block sizes
        stay known (its cache was flushed, it still publishes)."""
        with self.lock:
            for t in [t for t in self._blocks if t[0] == url]:
                self._drop(t)
            for k in list(self._spec):
                d = self._spec[k]
                for t in [t for t in d if t[0] == url]:
                    del d[t]
                if not d:
                    del self._spec[k]

    def drop_worker(self, url: str) -> None:
        """Forget every block of every DP rank of ``url``."""
        with self.lock:
            for t in [t for t in self._blocks if t[0] == url] + [t for t in self.block_size if t[0] == url]:
                self._drop(t)
                self.block_size.pop(t, None)

    # ------------------------------------------------------------ speculation
    def add_speculative(self, target: Target, tokens: list[int], ttl: float, now: float | None = None) -> int:
        """Count ``tokens``' full blocks as held by ``target`` for ``ttl`` s; returns the blocks added.

        Needs the target's block size (known from its first event); 0 blocks without it.
        """
        with self.lock:
            bs = self.block_size.get(target)
            if not bs or ttl <= 0:
                return 0
            now = time.monotonic() if now is None else now
            self._expire(now)
            exp = now + ttl
            keys = block_keys(tokens, bs)
            for k in keys:
                self._spec.setdefault(k, {})[target] = exp
                self._spec_q.append((exp, k, target))
            while len(self._spec_q) > self.max_blocks:
                _, k, t = self._spec_q.popleft()
                self._unspec(k, t, None)
            return len(keys)

    def _unspec(self, k: int, t: Target, exp: float | None) -> None:
        d = self._spec.get(k)
        if d is not None and t in d and (exp is None or d[t] <= exp):
            del d[t]
            if not d:
                del self._spec[k]

    def _expire(self, now: float) -> None:
        q = self._spec_q
        while q and q[0][0] <= now:
            exp, k, t = q.popleft()
            self._unspec(k, t, exp)

    # ------------------------------------------------------------ queries
    def match(self, tokens: list[int], targets: list[Target], now: float | None = None) -> dict:
        """Tokens of ``tokens``' prefix cached on each of ``targets`` (0 if none or block size unknown).

        A target's match is its longest run of consecutive blocks from the first,
        counting its unexpired speculative entries as held.  Cost: O(blocks x targets).
        """
        out = {t: 0 for t in targets}
        with self.lock:
            now = time.monotonic() if now is None else now
            self._expire(now)
            by_bs: dict[int, list] = {}
            for t in targets:
                bs = self.block_size.get(t)
                if bs:
                    by_bs.setdefault(bs, []).append(t)
            owners, spec = self._owners, self._spec
            for bs, ts in by_bs.items():
                active = set(ts)
                depth = 0
                for k in block_keys(tokens, bs):
                    held = owners.get(k, ())
                    sp = spec.get(k)
                    nxt = {t for t in active if t in held or (sp is not None and t in sp)}
                    if not nxt:
                        break
                    depth += bs
                    for t in nxt:
                        out[t] = depth
                    active = nxt
        return out

    def blocks_of(self, target: Target) -> int:
        """Blocks held by ``target`` according to its events."""
        with self.lock:
            return len(self._blocks.get(target, ()))

    def __len__(self) -> int:
        """(target, block) entries from events, all targets together (<= ``max_blocks``)."""
        return len(self._lru)
