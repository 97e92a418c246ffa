"""The router must never import torch (it runs on machines without it), nor
any fleetserve package outside ``fleetserve.router``."""

import ast
import subprocess
import sys
from pathlib import Path

import fleetserve.router


def test_router_modules_do_not_import_torch():
    code = ("import sys; import fleetserve.router.cli, fleetserve.router.app, "
            "fleetserve.router.admin, fleetserve.router.proxy, fleetserve.router.routes, "
            "fleetserve.router.metrics, fleetserve.router.health, fleetserve.router.kv_events.policy, "
            "fleetserve.router.kv_events.sources, fleetserve.router.kv_events.tokenize; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def _imported_modules(path: Path, package: str):
    """Absolute names of the modules ``path`` imports (``package`` is the one it sits in)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                yield ".".join(parts + ([node.module] if node.module else []))
            else:
                yield node.module


def test_router_imports_nothing_of_fleetserve_outside_the_router():
    root = Path(fleetserve.router.__file__).parent
    files = sorted(root.rglob("*.py"))
    assert len(files) > 10
    outside = []
    for f in files:
        package = ".".join(("fleetserve", "router") + f.relative_to(root).parent.parts)
        for name in _imported_modules(f, package):
            if (name == "fleetserve" or name.startswith("fleetserve.")) and not (
                    name == "fleetserve.router" or name.startswith("fleetserve.router.")):
                outside.append(f"{f.relative_to(root)}: {name}")
    assert outside == []
