"""Grammar compilation off the scheduler step.

A request with a grammar does not enter the scheduler's waiting queue at once:
:meth:`GrammarManager.submit` hands its grammar to one worker thread, which
builds the backend on first use (the tokenizer view), compiles the grammar
(cached by :class:`~fleetserve.engine.grammar.spec.GrammarKey`, LRU of
:data:`CACHE_SIZE`) and makes the request's matcher. Meanwhile the request holds
no batch slot and no KV; the scheduler calls :meth:`GrammarManager.take_ready`
at each step and queues the requests whose matcher is ready (SGLang's
``grammar_queue`` idea).

With ``sync=True`` (ranks of a tensor-parallel group, which must admit the same
requests on the same step) compilation happens inside :meth:`submit`.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections import OrderedDict
from typing import Any

from fleetserve.engine.grammar.backend import BackendFactory, GrammarBackend
from fleetserve.engine.grammar.spec import GrammarError, GrammarKey

CACHE_SIZE = 1024


class GrammarManager:
    """Compile grammars in a worker thread; hand back requests whose matcher is ready.

    Args:
        backend_factory: builds the :class:`GrammarBackend` (called once, in the worker).
        sync: compile inside :meth:`submit` instead (see the module docstring).
    """

    def __init__(self, backend_factory: BackendFactory, sync: bool = False):
        self._factory = backend_factory
        self._backend: GrammarBackend | None = None
        self._cache: OrderedDict[GrammarKey, str] = OrderedDict()
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="fleetserve-grammar")
        self.sync = sync
        self.pending: list[tuple[Any, cf.Future]] = []
        self.compiled = 0
        self.cache_hits = 0

    # ------------------------------------------------------------ worker side
    def _make_matcher(self, key: GrammarKey) -> Any:
        if self._backend is None:
            self._backend = self._factory()
        grammar = self._cache.get(key)
        if grammar is None:
            grammar = self._backend.compile(key)
            self.compiled += 1
            self._cache[key] = grammar
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self.cache_hits += 1
            self._cache.move_to_end(key)
        return self._backend.matcher(grammar)

    # --------------------------------------------------------- scheduler side
    def submit(self, req: Any, key: GrammarKey) -> None:
        """Start making ``req``'s matcher (its ``grammar`` slot is set when it is taken back)."""
        fut = self._pool.submit(self._make_matcher, key)
        if self.sync:
            cf.wait([fut])
        self.pending.append((req, fut))

    def take_ready(self) -> tuple[list[Any], list[tuple[Any, str]]]:
        """Requests whose matcher is ready (``req.grammar`` set), and ``(req, message)`` of those whose
        grammar failed; both leave the pending list, in submission order."""
        ready, failed, keep = [], [], []
        for req, fut in self.pending:
            if not fut.done():
                keep.append((req, fut))
                continue
            try:
                req.grammar = fut.result()
                ready.append(req)
            except GrammarError as e:
                failed.append((req, str(e)))
            except Exception as e:  # the library failed in an unexpected way: fail this request only
                failed.append((req, f"grammar compilation failed: {type(e).__name__}: {e}"))
        self.pending = keep
        return ready, failed

    def wait(self, timeout_s: float) -> None:
        """Block up to ``timeout_s`` for any pending compilation (when the scheduler has nothing else to do)."""
        if self.pending:
            cf.wait([f for _, f in self.pending], timeout=timeout_s, return_when=cf.FIRST_COMPLETED)

    def remove(self, rid: str) -> Any | None:
        """Take request ``rid`` out of the pending list (abort); its compilation still fills the cache."""
        for i, (req, _) in enumerate(self.pending):
            if req.rid == rid:
                del self.pending[i]
                return req
        return None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
