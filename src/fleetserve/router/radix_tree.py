"""Approximate radix tree shared by all workers ("tenants") of the router.

The router cannot see the workers' real KV caches, so it keeps its own guess:
every prompt it sent to a worker is inserted under that worker's name.  One
tree holds all tenants; each node records, per tenant, a logical clock value
of the last time the tenant's prompts passed through it.

Keys are Python ``str``: matching is by Unicode code point, never inside one
(a CJK character or an emoji is one unit, exactly like ``len(str)``).

Sizes are counted in characters *per tenant*: a node of ``k`` characters held
by 3 tenants adds ``k`` to each of their sizes.  ``total_size`` is the sum over
tenants and is what ``evict(max_size)`` bounds, so memory stays bounded however
many workers there are (the tree's own unique characters never exceed it).

Eviction is least-recently-used over tenant leaves (a node that a tenant holds
and none of whose children that tenant holds), trimmed to the character: when
dropping a whole leaf would overshoot the budget, the leaf is split and only
its tail is dropped for that tenant.  After ``evict(n)`` the total is exactly
``min(total, n)``.

Design follows the cache-aware router described in SGLang's router
(sgl-router ``tree.rs``); this module is an independent implementation.
"""

from __future__ import annotations

import heapq
import itertools


class _Node:
    """One edge label plus the tenants that hold it.

    ``text``: the characters on the edge from ``parent`` to this node.
    ``children``: first character of the child's ``text`` -> child.
    ``tenants``: tenant -> clock value of its last access.
    """

    __slots__ = ("text", "parent", "children", "tenants")

    def __init__(self, text: str, parent: "_Node | None") -> None:
        self.text = text
        self.parent = parent
        self.children: dict[str, _Node] = {}
        self.tenants: dict[str, int] = {}


def _common_prefix_len(text: str, pos: int, edge: str) -> int:
    """Length of the common prefix of ``text[pos:]`` and ``edge`` (binary search on C compares)."""
    if text.startswith(edge, pos):
        return len(edge)
    lo, hi = 1, min(len(edge), len(text) - pos)  # edge[0] == text[pos] is known by the caller
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if text.startswith(edge[:mid], pos):
            lo = mid
        else:
            hi = mid - 1
    return lo


class RadixTree:
    """Character radix tree with per-tenant LRU clocks and sizes.

    All operations are synchronous and must run on one thread (the router's
    event loop).  Costs: ``insert``/``match`` O(depth + len(text)) in C string
    compares with O(depth * log) Python steps; ``evict`` and
    ``remove_tenant`` walk the whole tree.
    """

    def __init__(self) -> None:
        self._root = _Node("", None)
        self._clock = itertools.count(1)
        self._sizes: dict[str, int] = {}
        self._total = 0
        self._shape = 0  # changes whenever a node is added, split or unlinked
        # the last match_per_tenant: (text, _shape then, the nodes it matched whole, in path order);
        # an insert of that very text while the shape is unchanged starts below them
        self._walked: tuple[str, int, list] | None = None

    # ------------------------------------------------------------------ sizes
    @property
    def total_size(self) -> int:
        """Sum over tenants of the characters each holds."""
        return self._total

    def tenant_size(self, tenant: str) -> int:
        """Characters held by ``tenant`` (0 if unknown)."""
        return self._sizes.get(tenant, 0)

    def tenant_sizes(self) -> dict[str, int]:
        """A copy of tenant -> characters held."""
        return dict(self._sizes)

    # ----------------------------------------------------------------- insert
    def insert(self, text: str, tenant: str) -> tuple[int, int] | None:
        """Record that ``text`` was sent to ``tenant``.  Empty text is ignored (returns None).

        Returns the claim ``(stamp, fresh)`` for :meth:`retract`: this insert's clock value and the
        number of leading characters of ``text`` the tenant held before it (``len(text)``: it added
        nothing).
        """
        if not text:
            return None
        now = next(self._clock)
        fresh = -1
        sizes = self._sizes
        added = 0
        node = self._root
        pos = 0
        n = len(text)
        walked = self._walked
        if walked is not None and walked[0] is text and walked[1] == self._shape:
            for child in walked[2]:  # as the loop below would take them: each whole edge, from the root
                if tenant not in child.tenants:
                    if fresh < 0:
                        fresh = pos
                    added += len(child.text)
                child.tenants[tenant] = now
                pos += len(child.text)
                node = child
        while pos < n:
            child = node.children.get(text[pos])
            if child is None:
                leaf = _Node(text[pos:], node)
                leaf.tenants[tenant] = now
                node.children[text[pos]] = leaf
                self._shape += 1
                if fresh < 0:
                    fresh = pos
                added += n - pos
                break
            edge = child.text
            k = _common_prefix_len(text, pos, edge)
            if k < len(edge):
                child = self._split(child, k)
            if tenant not in child.tenants:
                if fresh < 0:
                    fresh = pos
                added += k
            child.tenants[tenant] = now
            node = child
            pos += k
        if added:
            sizes[tenant] = sizes.get(tenant, 0) + added
            self._total += added
        elif tenant not in sizes:
            sizes[tenant] = 0
        return now, (n if fresh < 0 else fresh)

    def retract(self, text: str, tenant: str, claim: tuple[int, int] | None) -> int:
        """Take back what :meth:`insert` ``(text, tenant)`` added, returned as ``claim``: the request never
        reached that worker's cache (it answered 4xx, or busy).  Returns the characters dropped.

        Only the tenant's hold on ``text[fresh:]`` goes, and only on nodes whose stamp for the tenant is
        still this insert's: a later insert through them for the same tenant (the same text, or a longer
        or shorter one: a request that did reach it) refreshed those stamps, so what it holds stays.
        The prefix the tenant held before keeps its refreshed stamp (LRU order only).
        """
        if claim is None:
            return 0
        stamp, fresh = claim
        n = len(text)
        if fresh >= n:
            return 0
        path: list[tuple[_Node, int]] = []  # (node, characters of text before it)
        node, pos = self._root, 0
        while pos < n:
            child = node.children.get(text[pos])
            if child is None or not text.startswith(child.text, pos):
                break  # evicted or split apart since: nothing of it is held past here
            path.append((child, pos))
            pos += len(child.text)
            node = child
        dropped = 0
        for node, start in reversed(path):
            if start + len(node.text) <= fresh:
                break
            held = node.tenants.get(tenant)
            if held is None:
                continue  # evicted for this tenant since (others still hold the node): look above
            if held != stamp:
                break
            if start < fresh:  # the tenant held this node's head before: keep the head, drop the tail
                self._split(node, fresh - start)  # node keeps the tail
            k = len(node.text)
            self._drop(node, tenant)
            dropped += k
        if dropped:
            self._shape += 1
        return dropped

    def _split(self, node: _Node, k: int) -> _Node:
        """Split ``node`` after ``k`` chars; return the new upper node (same tenants)."""
        self._shape += 1
        parent = node.parent
        upper = _Node(node.text[:k], parent)
        upper.tenants = dict(node.tenants)
        parent.children[upper.text[0]] = upper
        node.text = node.text[k:]
        node.parent = upper
        upper.children[node.text[0]] = node
        return upper

    # ------------------------------------------------------------------ match
    def match(self, text: str) -> tuple[int, dict[str, int]]:
        """Longest prefix of ``text`` held by any tenant.

        Returns ``(matched_chars, owners)`` where ``owners`` maps every tenant
        holding all ``matched_chars`` characters to its last-access clock
        (a live view: do not mutate).  ``(0, {})`` when nothing matches.
        """
        node = self._root
        pos = 0
        n = len(text)
        last = None
        while pos < n:
            child = node.children.get(text[pos])
            if child is None:
                break
            edge = child.text
            if text.startswith(edge, pos):
                pos += len(edge)
                node = last = child
                continue
            pos += _common_prefix_len(text, pos, edge)
            last = child
            break
        if last is None:
            return 0, {}
        return pos, last.tenants

    def prefix_match(self, text: str) -> tuple[int, str | None]:
        """``(matched_chars, tenant)``: the owner of the longest match used most recently."""
        matched, owners = self.match(text)
        if not owners:
            return 0, None
        return matched, max(owners, key=owners.__getitem__)

    def prefix_match_tenant(self, text: str, tenant: str) -> int:
        """Characters of ``text``'s prefix that ``tenant`` holds."""
        node = self._root
        pos = 0
        n = len(text)
        while pos < n:
            child = node.children.get(text[pos])
            if child is None or tenant not in child.tenants:
                break
            edge = child.text
            if text.startswith(edge, pos):
                pos += len(edge)
                node = child
                continue
            pos += _common_prefix_len(text, pos, edge)
            break
        return pos

    def match_per_tenant(self, text: str) -> dict[str, int]:
        """Characters of ``text``'s prefix held by each tenant that holds any of it.

        One walk down ``text``'s path: a tenant's match ends at the deepest node
        on the path it still holds (a child's tenants are a subset of its
        parent's). Cost: path length x tenants per node.  The nodes matched whole
        are remembered, so that an :meth:`insert` of this very ``text`` object
        next (kv_aware matches a prompt, then records it) does not walk them again.
        """
        node = self._root
        pos = 0
        n = len(text)
        out: dict[str, int] = {}
        path = []
        while pos < n:
            child = node.children.get(text[pos])
            if child is None:
                break
            edge = child.text
            full = text.startswith(edge, pos)
            pos += len(edge) if full else _common_prefix_len(text, pos, edge)
            for t in child.tenants:
                out[t] = pos
            if not full:
                break
            path.append(child)
            node = child
        self._walked = (text, self._shape, path)
        return out

    # ---------------------------------------------------------------- removal
    def _drop(self, node: _Node, tenant: str) -> None:
        """Remove ``tenant`` from ``node`` (a tenant leaf) and unlink the node if nobody holds it."""
        del node.tenants[tenant]
        k = len(node.text)
        self._sizes[tenant] -= k
        self._total -= k
        if not node.tenants:
            del node.parent.children[node.text[0]]
            node.parent = None
            self._shape += 1

    def _nodes(self):
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def remove_tenant(self, tenant: str) -> None:
        """Forget everything ``tenant`` holds."""
        for node in list(self._nodes()):
            if tenant in node.tenants:
                del node.tenants[tenant]
                if not node.tenants and node.parent is not None:
                    del node.parent.children[node.text[0]]
                    node.parent = None
                    self._shape += 1
        self._root.tenants.pop(tenant, None)
        self._total -= self._sizes.pop(tenant, 0)

    def evict(self, max_size: int) -> int:
        """Drop least-recently-used tenant leaves until ``total_size <= max_size``.

        Returns the characters dropped.  Raises ``ValueError`` for a negative budget.
        """
        if max_size < 0:
            raise ValueError(f"max_size must be >= 0, got {max_size}")
        excess = self._total - max_size
        if excess <= 0:
            return 0
        heap: list[tuple[int, int, str, _Node]] = []
        seq = itertools.count()
        for node in self._nodes():
            kids = node.children.values()
            for tenant, stamp in node.tenants.items():
                if not any(tenant in c.tenants for c in kids):
                    heap.append((stamp, next(seq), tenant, node))
        heapq.heapify(heap)
        dropped = 0
        while excess > 0 and heap:
            stamp, _, tenant, node = heapq.heappop(heap)
            if node.parent is None or node.tenants.get(tenant) != stamp:
                continue  # stale entry
            k = len(node.text)
            if k > excess:
                # keep the head for this tenant, drop only the tail
                self._split(node, k - excess)
                k = len(node.text)
            parent = node.parent
            self._drop(node, tenant)
            excess -= k
            dropped += k
            if parent is not self._root and tenant in parent.tenants:
                if not any(tenant in c.tenants for c in parent.children.values()):
                    heapq.heappush(heap, (parent.tenants[tenant], next(seq), tenant, parent))
        return dropped

    # ------------------------------------------------------------- inspection
    def tenant_prefixes(self, tenant: str) -> dict[str, int]:
        """Every non-empty prefix ``tenant`` holds -> its last-access clock (for tests; O(size^2))."""
        out: dict[str, int] = {}
        stack = [(c, "") for c in self._root.children.values()]
        while stack:
            node, above = stack.pop()
            if tenant not in node.tenants:
                continue
            stamp = node.tenants[tenant]
            for i in range(1, len(node.text) + 1):
                out[above + node.text[:i]] = stamp
            full = above + node.text
            stack.extend((c, full) for c in node.children.values())
        return out

    def recount(self) -> dict[str, int]:
        """Tenant sizes recounted by walking the tree (for tests)."""
        counts: dict[str, int] = {t: 0 for t in self._sizes}
        for node in self._nodes():
            for tenant in node.tenants:
                counts[tenant] = counts.get(tenant, 0) + len(node.text)
        return counts
