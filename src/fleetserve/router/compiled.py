"""The router's hot path compiled with Cython, and the guard that never runs a stale build.

The modules in :data:`MODULES` (the request path: HTTP server and client, proxy, the policies,
kv_aware's tokenizer, index and cost) stay plain Python source, the one copy anyone reads or
edits.  ``pip install`` (``setup.py``) also compiles each of them with Cython into an extension
module next to its source, named ``<module>.fscompiled<EXT_SUFFIX>`` (e.g.
``radix_tree.fscompiled.cpython-311-x86_64-linux-gnu.so``), with ``annotation_typing=False`` so that the annotations change
nothing: the compiled module behaves as the source does, only with less interpreter work per
request (docs/benchmarks.md ``router-compiled``).  Without a C compiler or Cython, or with
``FLEETSERVE_PURE_PYTHON=1`` at install time, nothing is compiled and the router runs the source.

Python's own import system never loads those files: under that name they match no module, so a
checkout of older code, a module taken off :data:`MODULES` or a source deleted or renamed never runs
an old build.  The build writes the SHA-256 of each source, read before it is compiled, into
:data:`MANIFEST`; :func:`install` (called when ``fleetserve.router`` is imported, before any of
these modules) puts a finder first on ``sys.meta_path`` that loads a listed module's extension only
while its source still has that digest, and otherwise the source (:func:`status` says why; the
router's start-up log warns).  ``FLEETSERVE_PURE_PYTHON=1`` at run time loads every one of them
from source.

Standard library only: ``setup.py`` reads :data:`MODULES` from this file before anything is installed.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys

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
TAG = ".fscompiled"  # between a module's name and the extension suffix: a file name no import looks for
SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]  # this interpreter's, e.g. .cpython-311-x86_64-linux-gnu.so

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
    """Finds the modules of :data:`MODULES`: their extension (``<name>`` :data:`TAG` :data:`SUFFIX`
    beside the source) while it was built from the source as it is now, else their source.
    ``reasons[name]`` says why a module runs from source."""

    def __init__(self, pure: bool = False) -> None:
        self.pure = pure
        self.reasons: dict[str, str] = {}
        self._manifest: dict | None = None  # read on the first extension found

    def find_spec(self, name, path, target=None):
        if name not in _NAMES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)  # the source (nothing else has that name)
        source = getattr(spec, "origin", None) or ""
        if not source.endswith(".py"):
            return spec
        leaf = name.rpartition(".")[2]
        ext = os.path.join(os.path.dirname(source), leaf + TAG + SUFFIX)
        if not os.path.exists(ext):
            self.reasons[name] = "not compiled"
            return spec
        if self.pure:
            self.reasons[name] = f"{PURE_ENV}=1"
            return spec
        if self._manifest is None:
            self._manifest = _manifest(_HERE)
        built = self._manifest.get(name)
        try:
            fresh = built is not None and built == source_digest(source)
        except OSError:
            fresh = False
        if not fresh:
            self.reasons[name] = (STALE if built is not None
                                  else "the last install did not compile it (an older build)")
            return spec
        return importlib.util.spec_from_file_location(
            name, ext, loader=importlib.machinery.ExtensionFileLoader(name, ext))


STALE = "its source changed since it was compiled"
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
        elif (getattr(mod, "__file__", "") or "").endswith(TAG + SUFFIX):
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


def warning() -> str | None:
    """One line for the router to warn with, or None: the imported hot-path modules that run from
    source although nobody asked for that (``FLEETSERVE_PURE_PYTHON=1`` is asking)."""
    st = status()
    stale = sorted(k.rpartition(".")[2] for k, v in st.items() if v == "source: " + STALE)
    older = sorted(k.rpartition(".")[2] for k, v in st.items() if v.startswith("source: the last install"))
    plain = sorted(k.rpartition(".")[2] for k, v in st.items() if v == "source: not compiled")
    parts = []
    if stale:
        parts.append(f"changed since they were compiled: {', '.join(stale)} (pip install -e . compiles them again)")
    if older:
        parts.append(f"not compiled by the last install: {', '.join(older)}")
    if plain and not any(v == "compiled" for v in st.values()):
        parts.append("no compiled build (the install found no C compiler or Cython, or the tree was not installed)")
    elif plain:  # the install compiled the others: these failed (pip install -v shows why)
        parts.append(f"the install could not compile {', '.join(plain)}")
    return ("the router's hot path runs from source, slower: " + "; ".join(parts)) if parts else None


def report() -> str:
    """Import every hot-path module and say how they run: :func:`summary`, then :func:`warning` if
    any (``scripts/setup.sh`` prints it, since pip shows a build's own warnings only with ``-v``)."""
    import importlib

    for name in MODULES:
        importlib.import_module(name)
    slow = warning()
    return summary() + ("" if slow is None else f"\nwarning: {slow}")
