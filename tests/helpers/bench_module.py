"""Load a script of ``benchmarks/`` as a module, for the tests of its pure parts."""

import importlib.util
import os
import sys
from types import ModuleType

BENCH = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))


def load_bench(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as module ``<name>_bench``; ``benchmarks/`` is on ``sys.path`` while it
    loads, since the scripts import their siblings (doc_section, routing_kv, ...)."""
    sys.path.insert(0, BENCH)
    try:
        spec = importlib.util.spec_from_file_location(f"{name}_bench", os.path.join(BENCH, f"{name}.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(BENCH)
