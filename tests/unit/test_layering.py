"""The package is built in floors: each package imports only the floors below it.

Every module under ``src/fleetserve`` is parsed (ast) and every ``import`` /
``from ... import`` of a ``fleetserve`` module is collected, at module level
and inside functions alike (a function-local import is still a dependency).
The floors, lowest first, are :data:`FLOORS`; the router is a wing of its own
that imports nothing from the engine side, and the engine side nothing from
it. docs/architecture.md describes the same order.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parents[2] / "src"
ROOT = SRC / "fleetserve"

# Lowest first. A package may import its own modules and any package listed before it.
FLOORS = ["core", "distributed", "layers", "models", "engine", "entrypoints", "testing", "bench", "launch", "cli"]
# The router's wing: it may import only itself (it must run without torch).
WING = "router"


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: pathlib.Path) -> set[str]:
    """Absolute names of the fleetserve modules ``path`` imports (relative imports resolved)."""
    mod = module_name(path)
    package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            # ``from fleetserve.x import y`` may name a module y.
            found.update(f"{target}.{a.name}" for a in node.names)
    return {m for m in found if m == "fleetserve" or m.startswith("fleetserve.")}


def package_of(module: str) -> str | None:
    """``fleetserve.engine.scheduler`` -> ``engine``; the bare root -> None."""
    parts = module.split(".")
    if len(parts) < 2:
        return None
    return parts[1]


def existing_packages() -> set[str]:
    names = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    names |= {p.stem for p in ROOT.glob("*.py") if p.stem != "__init__"}
    return names


def package_edges() -> dict[tuple[str, str], list[str]]:
    """``{(importer_package, imported_package): ["module -> module", ...]}`` between distinct packages."""
    known = existing_packages()
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        src_mod = module_name(path)
        src_pkg = package_of(src_mod)
        if src_pkg is None:  # the root __init__: lazily re-exports fleetserve.Engine, above every floor
            continue
        for target in imported_modules(path):
            dst_pkg = package_of(target)
            if dst_pkg is None or dst_pkg == src_pkg or dst_pkg not in known:
                continue  # the root (``__version__``), same package, or a name that is not a module
            edges.setdefault((src_pkg, dst_pkg), []).append(f"{src_mod} -> {target}")
    return edges


def violations() -> list[str]:
    out = []
    edges = package_edges()
    for (a, b), where in sorted(edges.items()):
        if WING in (a, b):
            out.append(f"{a} imports {b} (the router imports only itself, nothing imports it): {where[0]}")
            continue
        if a not in FLOORS or b not in FLOORS:
            out.append(f"package {a if a not in FLOORS else b!r} has no floor in FLOORS: {where[0]}")
            continue
        if FLOORS.index(b) > FLOORS.index(a):
            out.append(f"{a} imports {b}, a floor above it: {where[0]}")
    for (a, b) in sorted(edges):
        if a < b and (b, a) in edges:
            out.append(f"{a} and {b} import each other: {edges[(a, b)][0]} / {edges[(b, a)][0]}")
    return out


def test_every_package_has_a_floor():
    missing = sorted(existing_packages() - set(FLOORS) - {WING})
    assert missing == [], f"add these packages to FLOORS (and docs/architecture.md): {missing}"


def test_no_import_runs_up_a_floor_and_no_package_circles():
    found = violations()
    assert found == [], "\n".join(found)


def test_checker_sees_upward_and_circular_imports(tmp_path, monkeypatch):
    """The checker itself: a tree where layers imports engine and engine imports layers fails twice."""
    root = tmp_path / "src" / "fleetserve"
    for pkg, body in {"layers": "from fleetserve.engine.scheduler import Scheduler\n",
                      "engine": "def f():\n    from ..layers import attention\n"}.items():
        (root / pkg).mkdir(parents=True)
        (root / pkg / "__init__.py").write_text("")
        (root / pkg / "mod.py").write_text(body)
    (root / "__init__.py").write_text("")
    monkeypatch.setitem(globals(), "SRC", tmp_path / "src")
    monkeypatch.setitem(globals(), "ROOT", root)
    found = violations()
    assert any("layers imports engine, a floor above it" in v for v in found), found
    assert any("engine and layers import each other" in v for v in found), found


@pytest.mark.parametrize("package", ["core", "distributed", "layers", "models", "engine"])
def test_engine_core_never_imports_the_web_stack(package):
    """FastAPI / starlette belong to the front door (entrypoints), never below it."""
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{path.name}: {n}" for n in names if n.split(".")[0] in ("fastapi", "starlette", "uvicorn")]
    assert bad == []
