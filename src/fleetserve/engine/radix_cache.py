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

Paging (``--page-size N``, the allocator's ``page_size``): the tree holds
only whole pages. Node keys have lengths that are multiples of ``N`` and split
only at page boundaries; children are keyed by their first page; a match is
rounded down to whole pages (10 cached tokens at ``N = 4`` match 8);
:meth:`RadixCache.insert` takes only the whole pages of what it is given, so a
request's partial last page stays its own and is freed with it. ``N = 1`` is
the token-level tree of before (children keyed by a token id).

KV events: with ``event_sink`` (a :class:`~fleetserve.engine.kv_event_sink.KVEventSink`)
every node also stores the chained SHA-256 digests of its pages
(:mod:`fleetserve.engine.page_hash`), split with its key, and the cache reports
``block_stored`` per new node, ``block_removed`` per evicted leaf and
``all_blocks_cleared`` on reset. Without a sink nothing is hashed.

LRU eviction removes unreferenced leaves, least recently used first, and
gives their slots back to the allocator. With ``disable=True`` the cache
stores nothing: ``match_prefix`` returns no slots and ``insert`` returns 0, so
callers free their slots themselves.

The structure follows SGLang's ``RadixCache`` (Zheng et al. 2024, "SGLang:
Efficient Execution of Structured Language Model Programs"); the code is our own.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Sequence

import torch

from fleetserve.core.kv_pool import TokenSlotAllocator
from fleetserve.engine.kv_event_sink import KVEventSink
from fleetserve.engine.page_hash import digest_to_int64, page_digests

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
        hashes: 32-byte chained SHA-256 digest of each page of ``key`` when the cache
            has an event sink, else ``None``.
    """

    __slots__ = ("key", "value", "children", "parent", "lock_ref", "last_access", "hashes")

    def __init__(self, key: list[int], value: torch.Tensor, parent: "TreeNode | None", last_access: int):
        self.key = key
        self.value = value
        self.children: dict[int, TreeNode] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = last_access
        self.hashes: list[bytes] | None = None

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
            it; its ``page_size`` is the tree's page size), or an ``int`` pool size
            to make a private allocator (useful without a model, e.g. in a simulated worker).
        disable: store nothing (``--disable-radix-cache``).
        page_size: only with an ``int`` ``allocator``: the private allocator's page size.
        event_sink: receiver of KV events (see the module docstring), or ``None``.

    Sizes are in tokens (= KV slots).
    """

    def __init__(self, allocator: TokenSlotAllocator | int, disable: bool = False, page_size: int = 1,
                 event_sink: KVEventSink | None = None):
        if isinstance(allocator, int):
            allocator = TokenSlotAllocator(allocator, page_size)
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.disable = disable
        self.event_sink = None if disable else event_sink  # a disabled cache holds nothing to report
        self._clock = itertools.count(1)
        self._new_root()

    # ------------------------------------------------------------------ state
    def _new_root(self) -> None:
        self.root = TreeNode([], _EMPTY, None, 0)
        self.root.lock_ref = 1  # the root is never evicted
        self._evictable = 0
        self._protected = 0

    def reset_tree(self) -> None:
        """Forget every node without freeing slots (callers that cleared the allocator).

        Reports ``all_blocks_cleared`` to the event sink.
        """
        self._new_root()
        if self.event_sink is not None:
            self.event_sink.all_blocks_cleared()

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

    def page_aligned(self, n: int) -> int:
        """``n`` rounded down to whole pages: how many of ``n`` tokens the tree can hold."""
        return n - n % self.page_size

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

    def _child_key(self, key: list[int], pos: int):
        """Dict key of the child whose key starts at ``key[pos]``: a token id, or the first page's tuple."""
        return key[pos] if self.page_size == 1 else tuple(key[pos: pos + self.page_size])

    # ---------------------------------------------------------------- matching
    def match_prefix(self, token_ids: Sequence[int]) -> tuple[torch.Tensor, TreeNode]:
        """Longest cached prefix of ``token_ids``, in whole pages.

        Args:
            token_ids: a list (or tuple) of int token ids.

        Returns:
            ``(slots, last_node)``: int64 ``[m]`` KV slots of the first ``m`` tokens
            (``m`` a multiple of the page size) and the node where the match ends
            (the root when ``m == 0``). A node is split (at a page boundary) when
            the match ends inside it, so ``last_node`` covers exactly the matched
            tokens; lock it with :meth:`inc_lock_ref` to keep them. Touches the
            matched nodes for LRU.
        """
        if self.disable or not token_ids:
            return _EMPTY, self.root
        token_ids = list(token_ids) if not isinstance(token_ids, list) else token_ids
        ps = self.page_size
        end = len(token_ids) - len(token_ids) % ps
        now = next(self._clock)
        node = self.root
        node.last_access = now
        pos = 0
        parts: list[torch.Tensor] = []
        while pos < end:
            child = node.children.get(self._child_key(token_ids, pos))
            if child is None:
                break
            k = _common_len(token_ids, pos, child.key)
            if ps > 1:
                k -= k % ps
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
        """Split ``child`` after its first ``k`` tokens (a page multiple); return the new upper node."""
        upper = TreeNode(child.key[:k], child.value[:k], child.parent, child.last_access)
        upper.lock_ref = child.lock_ref
        upper.children = {self._child_key(child.key, k): child}
        child.parent.children[self._child_key(child.key, 0)] = upper
        child.parent = upper
        if child.hashes is not None:
            cut = k // self.page_size
            upper.hashes, child.hashes = child.hashes[:cut], child.hashes[cut:]
        child.key = child.key[k:]
        child.value = child.value[k:]
        return upper

    # --------------------------------------------------------------- inserting
    def insert(self, token_ids: Sequence[int], slots: torch.Tensor) -> int:
        """Add the whole pages of ``token_ids`` with their KV ``slots`` (int64 ``[len(token_ids)]``).

        Only the first :meth:`page_aligned` ``(len(token_ids))`` tokens are
        considered; the caller keeps (and eventually frees) the slots of a
        trailing partial page.

        Returns:
            How many leading tokens were already cached (a page multiple). For
            those, the tree keeps its own slots and the caller still owns
            ``slots[:returned]`` (free the ones that are not the tree's, typically
            ``slots[matched:returned]``). ``slots[returned:page_aligned(len)]`` now
            belong to the tree (evictable unless a locked node lies below). ``0``
            when disabled.

        Raises:
            ValueError: when lengths differ.
        """
        if self.disable:
            return 0
        token_ids = list(token_ids) if not isinstance(token_ids, list) else token_ids
        if len(token_ids) != int(slots.numel()):
            raise ValueError(f"insert: {len(token_ids)} tokens but {int(slots.numel())} slots")
        ps = self.page_size
        end = len(token_ids) - len(token_ids) % ps
        now = next(self._clock)
        node = self.root
        pos = 0
        while pos < end:
            child = node.children.get(self._child_key(token_ids, pos))
            if child is None:
                self._add_leaf(node, token_ids[pos:end], slots[pos:end].clone(), now)
                return pos
            k = _common_len(token_ids, pos, child.key)
            if ps > 1:
                k -= k % ps
                k = min(k, end - pos)
            if k < len(child.key):
                child = self._split(child, k)
            child.last_access = now
            pos += k
            node = child
        return pos

    def _add_leaf(self, parent: TreeNode, key: list[int], value: torch.Tensor, now: int) -> None:
        new = TreeNode(key, value, parent, now)
        parent.children[self._child_key(key, 0)] = new
        self._evictable += len(key)
        sink = self.event_sink
        if sink is not None:
            prior = parent.hashes[-1] if parent is not self.root and parent.hashes else None
            new.hashes = page_digests(key, self.page_size, prior)
            sink.block_stored([digest_to_int64(d) for d in new.hashes],
                              None if prior is None else digest_to_int64(prior), list(key), self.page_size)

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
        given back to the allocator (may exceed ``num_tokens`` by part of a leaf;
        always whole pages). Reports each evicted leaf's pages as ``block_removed``.
        """
        if self.disable or num_tokens <= 0:
            return 0
        heap = [n for n in self._nodes() if not n.children and n.lock_ref == 0 and n is not self.root]
        heapq.heapify(heap)
        freed = 0
        sink = self.event_sink
        while freed < num_tokens and heap:
            leaf = heapq.heappop(heap)
            self.allocator.free(leaf.value)
            freed += len(leaf.key)
            self._evictable -= len(leaf.key)
            parent = leaf.parent
            del parent.children[self._child_key(leaf.key, 0)]
            if sink is not None and leaf.hashes:
                sink.block_removed([digest_to_int64(d) for d in leaf.hashes])
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
        return freed

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
        allocator: the pool's allocator (slots ``1 .. size``; paged: pages ``1 .. num_pages``).
        cache: the radix cache (its tree's slots are "cached"), or ``None``.
        in_use: slot tensors owned privately by running requests. With
            ``page_size > 1`` each counts as the whole pages holding it (a
            request's partial last page is its own, used or not).

    Also checks the cache's evictable/protected counters against a walk of the
    tree, and with paging that every node holds whole, aligned pages (and one
    page hash per page when the cache has an event sink). Raises
    ``AssertionError`` with a description on any violation.
    """
    ps = allocator.page_size
    free = allocator.free_slots()
    cached = cache.all_slots() if cache is not None else _EMPTY
    used = [t.reshape(-1).to(torch.int64) for t in in_use]
    if ps > 1:
        used = [allocator.page_slots(allocator.pages_of(t)) for t in used if t.numel()]
    used_all = torch.cat(used) if used else _EMPTY
    total = int(free.numel() + cached.numel() + used_all.numel())
    assert total == allocator.size, (
        f"KV leak: free {free.numel()} + cached {cached.numel()} + in use {used_all.numel()} "
        f"= {total} != pool size {allocator.size}")
    every = torch.cat([free, cached, used_all])
    lo = 1 if ps == 1 else ps
    assert bool((every >= lo).all()) and bool((every <= allocator.max_slot).all()), (
        f"KV slot out of range {lo}..{allocator.max_slot}")
    counts = torch.bincount(every, minlength=allocator.max_slot + 1)
    dup = torch.nonzero(counts > 1).flatten().tolist()
    assert not dup, f"KV slots in two places: {dup[:10]}"
    if cache is not None:
        assert cache.page_size == ps, "radix cache and allocator disagree on the page size"
        prot = evict = 0
        ramp = torch.arange(ps, dtype=torch.int64)
        for node in cache._nodes():
            if node is cache.root:
                continue
            assert len(node.key) == int(node.value.numel()) and len(node.key) > 0, "radix node key/value mismatch"
            assert len(node.key) % ps == 0, f"radix node of {len(node.key)} tokens is not whole pages of {ps}"
            if ps > 1:
                rows = node.value.view(-1, ps)
                assert bool((rows % ps == ramp).all()) and bool((rows - rows[:, :1] == ramp).all()), (
                    "radix node slots are not whole aligned pages")
            if node.hashes is not None:
                assert len(node.hashes) == len(node.key) // ps, "radix node page hashes out of step with its key"
            assert node.lock_ref >= 0, "negative lock_ref"
            if node.parent is not cache.root:
                assert node.parent.lock_ref >= node.lock_ref, "child locked more than its parent"
            if node.lock_ref > 0:
                prot += len(node.key)
            else:
                evict += len(node.key)
        assert prot == cache.protected_size(), f"protected_size {cache.protected_size()} != walked {prot}"
        assert evict == cache.evictable_size(), f"evictable_size {cache.evictable_size()} != walked {evict}"
