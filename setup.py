"""Build step beyond pyproject.toml: compile the router's hot path with Cython (optional).

The modules listed in ``src/fleetserve/router/compiled.py`` (``MODULES``) are compiled as they are
(``annotation_typing=False``: the same behaviour, less interpreter work) into extension modules next
to their sources, and the SHA-256 of each source compiled goes into ``compiled_sources.json`` there,
so that the router never runs an extension older than its source (see that module).  Without Cython
or a C compiler, or with ``FLEETSERVE_PURE_PYTHON=1``, a module that does not build is left as
source with one warning and the install goes on.
"""

import ast
import hashlib
import json
import os
import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
COMPILED_PY = os.path.join("src", "fleetserve", "router", "compiled.py")


def _constant(name: str):
    """A top-level constant of compiled.py, read without importing the package (not installed yet)."""
    with open(os.path.join(HERE, COMPILED_PY), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise RuntimeError(f"{COMPILED_PY} defines no {name}")


MODULES = _constant("MODULES")
MANIFEST = _constant("MANIFEST")
PURE = os.environ.get(_constant("PURE_ENV")) == "1"


def _source(module: str) -> str:
    return os.path.join("src", *module.split(".")) + ".py"


def _warn(msg: str) -> None:
    print(f"fleetserve setup: {msg}; the router runs that code from source (slower)", file=sys.stderr)


class OptionalBuildExt(build_ext):
    """build_ext that never fails the install, and writes the manifest of what it built."""

    def finalize_options(self):
        super().finalize_options()
        if self.parallel is None:  # one compiler per core
            self.parallel = os.cpu_count() or 1

    def run(self):
        self._built = []
        try:
            super().run()
        except Exception as e:  # no compiler at all, ...
            _warn(f"compiling failed ({type(e).__name__}: {e})")
        if not self.extensions:
            return
        out = os.path.dirname(self.get_ext_fullpath("fleetserve.router.compiled"))
        os.makedirs(out, exist_ok=True)
        digests = {}
        for name in self._built:
            with open(os.path.join(HERE, _source(name)), "rb") as f:
                digests[name] = hashlib.sha256(f.read()).hexdigest()
        with open(os.path.join(out, MANIFEST), "w", encoding="utf-8") as f:
            json.dump(digests, f, indent=1, sort_keys=True)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as e:
            _warn(f"compiling {ext.name} failed ({type(e).__name__}: {e})")
        else:
            self._built.append(ext.name)


def _extensions():
    if PURE:
        return []
    try:
        from Cython.Build import cythonize
    except ImportError:
        _warn("Cython is not installed")
        return []
    try:
        return cythonize([_source(m) for m in MODULES], build_dir=os.path.join("build", "cython"), quiet=True,
                         nthreads=os.cpu_count() or 1,
                         compiler_directives={"language_level": 3, "annotation_typing": False})
    except Exception as e:  # a module Cython cannot translate: build none rather than half
        _warn(f"Cython failed ({type(e).__name__}: {e})")
        return []


setup(ext_modules=_extensions(), cmdclass={"build_ext": OptionalBuildExt})
