"""Radix prefix cache over token ids: shared prompt prefixes reuse their KV slots.

A compressed trie. Each node holds a run of token ids (``key``) and the KV
slots of those tokens (``value``, int64 ``[len(key)]``). A path from the root
spells a token sequence whose KV is already computed and stored in the pool.

Ownership of KV slots (the invariant :func:`check_kv_invariant` verifies):

* **free**: in the :class:`~fleetserve.core.kv_pool.TokenSlotAllocator` free list;
* **cached**: in the tree; *protected* while some request holds a lock on a
  node at or below it (``lock_ref > 0``), *evictable* otherwise;
* **in use**: owned privately by a running request (computed but not yet
  inserted into the tree).

``free + cached + in use == pool size`` and no slot is in two places.

Typical request life cycle (the scheduler does this)::

    slots, node = cache.match_prefix(prompt)      # reuse len(slots) tokens
    cache.inc_lock_ref(node)                      # protect them while running
    ...compute the rest into freshly allocated slots...
    n_present = cache.insert(tokens, all_slots)   # hand the KV to the tree
    allocator.free(all_slots[len(slots):n_present])  # duplicates someone else inserted
    cache.dec_lock_ref(node)                      # now evictable

LRU eviction removes unreferenced leaves, least recently used first, and
gives their slots back to the allocator. With ``disable=True`` the cache
stores nothing: ``match_prefix`` returns no slots and ``insert`` returns 0, so
callers free their slots themselves.

The structure follows SGLang's ``RadixCache`` (Zheng et al. 2024, "SGLang:
Efficient Execution of Structured Language Model Programs"); the code is our own.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
from collections.abc import Iterable, Sequence

import torch

from fleetserve.core.kv_pool import TokenSlotAllocator
from fleetserve.engine.kv_event_sink import KVEventSink

_EMPTY = torch.zeros(0, dtype=torch.int64)


class TreeNode:
    """One edge of the radix tree (a run of tokens) plus its bookkeeping.

    Attributes:
        key: token ids of this run (a Python list; empty only at the root).
        value: int64 ``[len(key)]`` KV slots of those tokens.
        children: first token id of the child's key -> child.
        parent: ``None`` only at the root.
        lock_ref: how many running requests protect this node (and its ancestors).
        last_access: logical clock of the last match/insert touching it (LRU order).
        hashes: one page hash per token of ``key`` when the cache has an event sink, else ``None``.
    """

    __slots__ = ("key", "value", "children", "parent", "lock_ref", "last_access", "hashes")

    def __init__(self, key: list[int], value: torch.Tensor, parent: "TreeNode | None", last_access: int):
        self.key = key
        self.value = value
        self.children: dict[int, TreeNode] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = last_access
        self.hashes: list[int] | None = None

    def __lt__(self, other: "TreeNode") -> bool:  # heap order for eviction
        return self.last_access < other.last_access


def _common_len(a: Sequence[int], a_start: int, b: Sequence[int]) -> int:
    """Length of the common prefix of ``a[a_start:]`` and ``b`` (lists of ints).

    Compares blocks with C-level list equality first (a whole node usually
    matches), then finds the first difference inside the failing block.
    """
    n = min(len(a) - a_start, len(b))
    if a[a_start: a_start + n] == b[:n]:
        return n
    i = 0
    step = 64
    while i + step <= n and a[a_start + i: a_start + i + step] == b[i: i + step]:
        i += step
    while i < n and a[a_start + i] == b[i]:
        i += 1
    return i


class RadixCache:
    """Prefix cache mapping token-id sequences to KV slots.

    Args:
        allocator: the pool's :class:`TokenSlotAllocator` (evicted slots go back to
            it), or an ``int`` pool size to make a private allocator (useful
            without a model, e.g. in a simulated worker).
        disable: store nothing (``--disable-radix-cache``).
        event_sink: told about pages entering and leaving the tree
            (:class:`~fleetserve.engine.kv_event_sink.KVEventSink`); ``None``: no events.

    Sizes are in tokens (= KV slots).
    """

    def __init__(self, allocator: TokenSlotAllocator | int, disable: bool = False,
                 event_sink: KVEventSink | None = None):
        if isinstance(allocator, int):
            allocator = TokenSlotAllocator(allocator)
        self.allocator = allocator
        self.disable = disable
        self.event_sink = None if disable else event_sink
        self._clock = itertools.count(1)
        self.reset_tree()

    # ------------------------------------------------------------------ state
    def reset_tree(self) -> None:
        """Forget every node without freeing slots (callers that cleared the allocator)."""
        self.root = TreeNode([], _EMPTY, None, 0)
        self.root.lock_ref = 1  # the root is never evicted
        self._evictable = 0
        self._protected = 0

    def reset(self) -> None:
        """Free every cached slot back to the allocator and empty the tree.

        Raises:
            RuntimeError: when a request still holds a lock (``protected_size() > 0``).
        """
        if self._protected:
            raise RuntimeError(f"cannot reset the radix cache: {self._protected} tokens are locked by requests")
        slots = self.all_slots()
        if slots.numel():
            self.allocator.free(slots)
        self.reset_tree()
        if self.event_sink is not None:
            self.event_sink.all_blocks_cleared()

    def evictable_size(self) -> int:
        """Cached tokens no running request protects (can be evicted)."""
        return self._evictable

    def protected_size(self) -> int:
        """Cached tokens locked by running requests."""
        return self._protected

    def total_size(self) -> int:
        """All cached tokens (evictable + protected)."""
        return self._evictable + self._protected

    def all_slots(self) -> torch.Tensor:
        """Every slot held by the tree, int64 ``[total_size()]`` (for invariant checks)."""
        parts = [n.value for n in self._nodes() if n is not self.root]
        return torch.cat(parts) if parts else _EMPTY.clone()

    def _nodes(self) -> Iterable[TreeNode]:
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # ---------------------------------------------------------------- matching
    def match_prefix(self, token_ids: Sequence[int]) -> tuple[torch.Tensor, TreeNode]:
        """Longest cached prefix of ``token_ids``.

        Args:
            token_ids: a list (or tuple) of int token ids.

        Returns:
            ``(slots, last_node)``: int64 ``[m]`` KV slots of the first ``m`` tokens
            and the node where the match ends (the root when ``m == 0``). A node
            is split when the match ends inside it, so ``last_node`` covers exactly
            the matched tokens; lock it with :meth:`inc_lock_ref` to keep them.
            Touches the matched nodes for LRU.
        """
        if self.disable or not token_ids:
            return _EMPTY, self.root
        token_ids = list(token_ids) if not isinstance(token_ids, list) else token_ids
        now = next(self._clock)
        node = self.root
        node.last_access = now
        pos = 0
        parts: list[torch.Tensor] = []
        while pos < len(token_ids):
            child = node.children.get(token_ids[pos])
            if child is None:
                break
            k = _common_len(token_ids, pos, child.key)
            if k < len(child.key):
                child = self._split(child, k)
            child.last_access = now
            parts.append(child.value)
            pos += k
            node = child
        if not parts:
            return _EMPTY, self.root
        return (parts[0] if len(parts) == 1 else torch.cat(parts)), node

    def _split(self, child: TreeNode, k: int) -> TreeNode:
        """Split ``child`` after its first ``k`` tokens; return the new upper node."""
        upper = TreeNode(child.key[:k], child.value[:k], child.parent, child.last_access)
        upper.lock_ref = child.lock_ref
        if child.hashes is not None:
            upper.hashes, child.hashes = child.hashes[:k], child.hashes[k:]
        upper.children = {child.key[k]: child}
        child.parent.children[child.key[0]] = upper
        child.parent = upper
        child.key = child.key[k:]
        child.value = child.value[k:]
        return upper

    # --------------------------------------------------------------- inserting
    def insert(self, token_ids: Sequence[int], slots: torch.Tensor) -> int:
        """Add ``token_ids`` with their KV ``slots`` (int64 ``[len(token_ids)]``).

        Returns:
            How many leading tokens were already cached. For those, the tree keeps
            its own slots and the caller still owns ``slots[:returned]`` (free the
            ones that are not the tree's, typically ``slots[matched:returned]``).
            The remaining ``slots[returned:]`` now belong to the tree (evictable
            unless a locked node lies below). ``0`` when disabled.

        Raises:
            ValueError: when lengths differ.
        """
        if self.disable:
            return 0
        token_ids = list(token_ids) if not isinstance(token_ids, list) else token_ids
        if len(token_ids) != int(slots.numel()):
            raise ValueError(f"insert: {len(token_ids)} tokens but {int(slots.numel())} slots")
        now = next(self._clock)
        node = self.root
        pos = 0
        while pos < len(token_ids):
            child = node.children.get(token_ids[pos])
            if child is None:
                new = TreeNode(token_ids[pos:], slots[pos:].clone(), node, now)
                node.children[token_ids[pos]] = new
                self._evictable += len(new.key)
                if self.event_sink is not None:
                    self._report_stored(new)
                return pos
            k = _common_len(token_ids, pos, child.key)
            if k < len(child.key):
                child = self._split(child, k)
            child.last_access = now
            pos += k
            node = child
        return pos

    # ----------------------------------------------------------------- locking
    def inc_lock_ref(self, node: TreeNode) -> None:
        """Protect ``node`` and its ancestors from eviction (one more running user)."""
        if self.disable:
            return
        while node is not self.root:
            if node.lock_ref == 0:
                n = len(node.key)
                self._evictable -= n
                self._protected += n
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undo one :meth:`inc_lock_ref` on ``node``.

        Raises:
            RuntimeError: when a node's lock count would go negative.
        """
        if self.disable:
            return
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError("radix cache: dec_lock_ref on an unlocked node")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                n = len(node.key)
                self._evictable += n
                self._protected -= n
            node = node.parent

    # ----------------------------------------------------------------- evicting
    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` slots from unlocked leaves, least recently used first.

        Stops early when nothing evictable is left. Returns the number of slots
        given back to the allocator (may exceed ``num_tokens`` by part of a leaf).
        """
        if self.disable or num_tokens <= 0:
            return 0
        heap = [n for n in self._nodes() if not n.children and n.lock_ref == 0 and n is not self.root]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            leaf = heapq.heappop(heap)
            self.allocator.free(leaf.value)
            if self.event_sink is not None and leaf.hashes:
                self.event_sink.block_removed(list(leaf.hashes))
            freed += len(leaf.key)
            self._evictable -= len(leaf.key)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
        return freed

    # ------------------------------------------------------------------ events
    def _report_stored(self, node: TreeNode) -> None:
        """Give ``node`` its page hashes (page size 1: one per token) and report them as stored.

        TODO(pagesize): placeholder chain hash, to be replaced by the page hash of
        the --page-size work (SGLang's). Here each token is a page and its hash is
        the first 63 bits of blake2b(parent hash, token id), the parent of the
        first token being the last hash of the parent node (none at the root).
        """
        parent = node.parent
        parent_hash = parent.hashes[-1] if parent is not self.root and parent.hashes else None
        h = parent_hash
        hashes = []
        for t in node.key:
            prev = b"" if h is None else h.to_bytes(8, "big")
            h = int.from_bytes(hashlib.blake2b(prev + int(t).to_bytes(8, "big", signed=True),
                                               digest_size=8).digest(), "big") >> 1
            hashes.append(h)
        node.hashes = hashes
        self.event_sink.block_stored(list(hashes), parent_hash, list(node.key), 1)

    # ----------------------------------------------------------------- display
    def pretty(self) -> str:
        """Indented dump of the tree (debugging)."""
        lines: list[str] = []

        def walk(node: TreeNode, depth: int) -> None:
            for child in node.children.values():
                lines.append(f"{'  ' * depth}{child.key[:8]}{'...' if len(child.key) > 8 else ''} "
                             f"len={len(child.key)} lock={child.lock_ref}")
                walk(child, depth + 1)

        walk(self.root, 0)
        return "\n".join(lines)


def check_kv_invariant(allocator: TokenSlotAllocator, cache: RadixCache | None = None,
                       in_use: Iterable[torch.Tensor] = ()) -> None:
    """Assert the KV bookkeeping: free + cached + in use == pool size, no slot twice.

    Args:
        allocator: the pool's allocator (slots ``1 .. size``).
        cache: the radix cache (its tree's slots are "cached"), or ``None``.
        in_use: slot tensors owned privately by running requests.

    Also checks the cache's evictable/protected counters against a walk of the
    tree. Raises ``AssertionError`` with a description on any violation.
    """
    free = allocator.free_slots()
    cached = cache.all_slots() if cache is not None else _EMPTY
    used = [t.reshape(-1).to(torch.int64) for t in in_use]
    used_all = torch.cat(used) if used else _EMPTY
    total = int(free.numel() + cached.numel() + used_all.numel())
    assert total == allocator.size, (
        f"KV leak: free {free.numel()} + cached {cached.numel()} + in use {used_all.numel()} "
        f"= {total} != pool size {allocator.size}")
    every = torch.cat([free, cached, used_all])
    assert bool((every >= 1).all()) and bool((every <= allocator.size).all()), "KV slot out of range 1..size"
    counts = torch.bincount(every, minlength=allocator.size + 1)
    dup = torch.nonzero(counts > 1).flatten().tolist()
    assert not dup, f"KV slots in two places: {dup[:10]}"
    if cache is not None:
        prot = evict = 0
        for node in cache._nodes():
            if node is cache.root:
                continue
            assert len(node.key) == int(node.value.numel()) and len(node.key) > 0, "radix node key/value mismatch"
            assert node.lock_ref >= 0, "negative lock_ref"
            if node.parent is not cache.root:
                assert node.parent.lock_ref >= node.lock_ref, "child locked more than its parent"
            if node.lock_ref > 0:
                prot += len(node.key)
            else:
                evict += len(node.key)
        assert prot == cache.protected_size(), f"protected_size {cache.protected_size()} != walked {prot}"
        assert evict == cache.evictable_size(), f"evictable_size {cache.evictable_size()} != walked {evict}"
