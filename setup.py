"""Build step beyond pyproject.toml: compile the router's hot path with Cython (optional).

The modules listed in ``src/fleetserve/router/compiled.py`` (``MODULES``) are compiled as they are
(``annotation_typing=False``: the same behaviour, less interpreter work) into extension modules next
to their sources, under a name no import looks for (``<module>.fscompiled<EXT_SUFFIX>``: only that
module's finder loads them), and the SHA-256 of each source, read before Cython translates it, goes
into ``compiled_sources.json`` there, so that the router never runs an extension older than its
source (see that module).  Without Cython or a C compiler, or with ``FLEETSERVE_PURE_PYTHON=1``, a
module that does not build is left as source (its old extension, if any, removed) with one warning
(shown by ``pip install -v``; ``scripts/setup.sh`` prints the outcome) and the install goes on.
"""

import importlib.util
import json
import os
import sys
import sysconfig

from setuptools import setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
COMPILED_PY = os.path.join("src", "fleetserve", "router", "compiled.py")


def _compiled_module():
    """router/compiled.py itself (standard library only), loaded by path: the package is not installed yet."""
    spec = importlib.util.spec_from_file_location("_fleetserve_compiled", os.path.join(HERE, COMPILED_PY))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_C = _compiled_module()
MODULES, MANIFEST, TAG = _C.MODULES, _C.MANIFEST, _C.TAG
PURE = os.environ.get(_C.PURE_ENV) == "1"
LEAVES = {m.rpartition(".")[2] for m in MODULES}
DIGESTS: dict = {}  # module -> sha256 of its source as Cython read it (set by _extensions)


def _source(module: str) -> str:
    return os.path.join("src", *module.split(".")) + ".py"


def _warn(msg: str) -> None:
    print(f"fleetserve setup: {msg}; the router runs that code from source (slower)", file=sys.stderr)


class OptionalBuildExt(build_ext):
    """build_ext that never fails the install, names the extensions so that only compiled.py's finder
    loads them, copies (editable install) only those that built, removes the old ones of those that
    did not, and writes the manifest of what it built."""

    def finalize_options(self):
        super().finalize_options()
        if self.parallel is None:  # one compiler per core
            self.parallel = os.cpu_count() or 1

    def get_ext_filename(self, fullname):  # build_ext asks with the full name, and with the last part alone
        if fullname in MODULES or fullname in LEAVES:
            return os.path.join(*fullname.split(".")) + TAG + sysconfig.get_config_var("EXT_SUFFIX")
        return super().get_ext_filename(fullname)

    def copy_extensions_to_source(self):
        every = self.extensions
        self.extensions = [e for e in every if e.name in self._built]
        try:
            super().copy_extensions_to_source()
        finally:
            self.extensions = every

    def run(self):
        self._built = []
        try:
            super().run()
        except Exception as e:
            _warn(f"compiling failed ({type(e).__name__}: {e})")
        if not self.extensions:
            return
        if self.inplace:  # an editable install: a module that did not build must not keep an old extension
            for ext in self.extensions:
                old = os.path.join(HERE, "src", self.get_ext_filename(ext.name))
                if ext.name not in self._built and os.path.exists(old):
                    os.remove(old)
        out = os.path.dirname(self.get_ext_fullpath("fleetserve.router.compiled"))
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, MANIFEST), "w", encoding="utf-8") as f:
            json.dump({m: DIGESTS[m] for m in self._built}, f, indent=1, sort_keys=True)

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
    for m in MODULES:  # before Cython reads them: an edit during the build then shows as a changed source
        DIGESTS[m] = _C.source_digest(os.path.join(HERE, _source(m)))
    try:  # force: every C file is translated from the source just read, never an older one
        exts = cythonize([_source(m) for m in MODULES], build_dir=os.path.join("build", "cython"), quiet=True,
                         nthreads=os.cpu_count() or 1, force=True,
                         compiler_directives={"language_level": 3, "annotation_typing": False})
    except Exception as e:  # a module Cython cannot translate: build none rather than half
        _warn(f"Cython failed ({type(e).__name__}: {e})")
        return []
    for ext in exts:
        ext.optional = True  # a failed one is skipped by the copy of an editable install
    return exts


setup(ext_modules=_extensions(), cmdclass={"build_ext": OptionalBuildExt})
