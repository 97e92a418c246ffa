"""The router's hot path compiled with Cython, and the guard that never runs a stale build.

The modules in :data:`MODULES` (the request path: HTTP server and client, proxy, the policies,
kv_aware's tokenizer, index and cost) stay plain Python source, the one copy anyone reads or
edits.  ``pip install`` (``setup.py``) also compiles each of them with Cython into an extension
module next to its source, with ``annotation_typing=False`` so that the annotations change
nothing: the compiled module behaves as the source does, only with less interpreter work per
request (docs/benchmarks.md ``router-compiled``).  Without a C compiler or Cython, or with
``FLEETSERVE_PURE_PYTHON=1`` at install time, nothing is compiled and the router runs the source.

Python would import an extension module in preference to a source file of the same name even when
the source changed after the build (an edit, a ``git checkout``), and so run old code.  The build
writes the SHA-256 of each source it compiled into :data:`MANIFEST`; :func:`install` (called when
``fleetserve.router`` is imported, before any of these modules) puts a finder first on
``sys.meta_path`` that loads a module's extension only while its source still has that digest, and
otherwise the source, with one warning naming the module and the fix (reinstall).
``FLEETSERVE_PURE_PYTHON=1`` at run time loads every one of them from source.

Standard library only: ``setup.py`` reads :data:`MODULES` from this file before anything is installed.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import logging
import os
import sys

log = logging.getLogger("fleetserve.router")

# dotted names, in the order they are built (setup.py); each is a .py file under src/
MODULES = (
    "fleetserve.router.http.turn",
    "fleetserve.router.http.server",
    "fleetserve.router.http.client",
    "fleetserve.router.auth",
    "fleetserve.router.via",
    "fleetserve.router.body_fields",
    "fleetserve.router.routing_text",
    "fleetserve.router.route_header",
    "fleetserve.router.radix_tree",
    "fleetserve.router.workers",
    "fleetserve.router.circuit_breaker",
    "fleetserve.router.prediction",
    "fleetserve.router.metrics",
    "fleetserve.router.policies",
    "fleetserve.router.proxy",
    "fleetserve.router.kv_events.fast_bpe",
    "fleetserve.router.kv_events.tokenize",
    "fleetserve.router.kv_events.tokenizer_check",
    "fleetserve.router.kv_events.index",
    "fleetserve.router.kv_events.pending",
    "fleetserve.router.kv_events.held",
    "fleetserve.router.kv_events.loads",
    "fleetserve.router.kv_events.policy",
)
MANIFEST = "compiled_sources.json"  # beside this file: {module: sha256 of the source each extension was built from}
PURE_ENV = "FLEETSERVE_PURE_PYTHON"  # "1": build nothing (install) / load every module from source (run)

_HERE = os.path.dirname(os.path.abspath(__file__))
_NAMES = frozenset(MODULES)  # every import in the process asks the finder: one set look-up


def source_digest(path: str) -> str:
    """SHA-256 (hex) of the file at ``path``; raises OSError if it cannot be read."""
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _manifest(folder: str) -> dict:
    try:
        with open(os.path.join(folder, MANIFEST), encoding="utf-8") as f:
            got = json.load(f)
    except (OSError, ValueError):
        return {}
    return got if isinstance(got, dict) else {}


class FreshCompiledFinder(importlib.abc.MetaPathFinder):
    """Finds the modules of :data:`MODULES`: their extension while it was built from the source as it
    is now, else their source.  ``reasons[name]`` says why a module runs from source."""

    def __init__(self, pure: bool = False) -> None:
        self.pure = pure
        self.reasons: dict[str, str] = {}
        self._manifest: dict | None = None  # read on the first extension found

    def find_spec(self, name, path, target=None):
        if name not in _NAMES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        origin = getattr(spec, "origin", None) or ""
        if spec is None or not origin.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)):
            if spec is not None:
                self.reasons[name] = "not compiled"
            return spec
        folder = os.path.dirname(origin)
        source = os.path.join(folder, name.rpartition(".")[2] + ".py")
        if not os.path.exists(source):  # an install without sources: the extension is all there is
            return spec
        if self.pure:
            why = f"{PURE_ENV}=1"
        else:
            if self._manifest is None:
                self._manifest = _manifest(_HERE)
            built = self._manifest.get(name)
            try:
                fresh = built is not None and built == source_digest(source)
            except OSError:
                fresh = False
            if fresh:
                return spec
            why = ("its source changed since it was compiled" if built is not None
                   else "the last install did not compile it (an older build)")
            log.warning("fleetserve router: %s runs from source, slower: %s (pip install -e . compiles it again)",
                        name, why)
        self.reasons[name] = why
        return importlib.util.spec_from_file_location(name, source)


_finder: FreshCompiledFinder | None = None


def install() -> FreshCompiledFinder:
    """Put the finder first on ``sys.meta_path`` (once); returns it."""
    global _finder
    if _finder is None:
        _finder = FreshCompiledFinder(pure=os.environ.get(PURE_ENV) == "1")
        sys.meta_path.insert(0, _finder)
    return _finder


def status() -> dict[str, str]:
    """``{module: "compiled" | "source: <why>" | "not imported"}`` for every module of :data:`MODULES`."""
    out = {}
    for name in MODULES:
        mod = sys.modules.get(name)
        if mod is None:
            out[name] = "not imported"
        elif (getattr(mod, "__file__", "") or "").endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)):
            out[name] = "compiled"
        else:
            out[name] = "source: " + (_finder.reasons.get(name, "not compiled") if _finder else "not compiled")
    return out


def summary() -> str:
    """One line for the router's start-up log: how many of the hot-path modules run compiled."""
    st = status()
    loaded = {k: v for k, v in st.items() if v != "not imported"}
    n = sum(v == "compiled" for v in loaded.values())
    if n == len(loaded):
        return f"hot path compiled (Cython): {n} of {n} modules"
    slow = sorted(k.rpartition(".")[2] for k, v in loaded.items() if v != "compiled")
    return f"hot path compiled (Cython): {n} of {len(loaded)} modules; from source: {', '.join(slow)}"
