"""HTTP stays in the front door: read every module's imports (ast) and check who may import what."""

import ast
from pathlib import Path

import fleetserve

PKG = Path(fleetserve.__file__).parent
WEB = {"fastapi", "starlette", "pydantic", "uvicorn"}
ENGINE_CORE = ["core", "distributed", "layers", "models", "engine"]


def imports_of(path: Path) -> list[tuple[str, str | None]]:
    """(module, alias) for every import statement in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, a.asname) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found += [(f"{node.module}.{a.name}", a.asname) for a in node.names]
    return found


def web_imports(path: Path) -> list[str]:
    return [m for m, _ in imports_of(path) if m.split(".")[0] in WEB]


def test_the_engine_core_never_imports_a_web_framework():
    offenders = {str(p.relative_to(PKG)): web_imports(p)
                 for floor in ENGINE_CORE for p in (PKG / floor).rglob("*.py") if web_imports(p)}
    assert offenders == {}


def test_the_error_type_and_the_validation_are_plain():
    for name in ("errors.py", "validation.py"):
        path = PKG / "entrypoints" / name
        assert web_imports(path) == [], name


def test_no_module_uses_the_old_front_door_names():
    for p in PKG.rglob("*.py"):
        for module, alias in imports_of(p):
            assert "http_server" not in module.split("."), p
            if module.endswith("openai_protocol"):
                assert alias in (None, "protocol"), f"{p}: imports openai_protocol as {alias}"
