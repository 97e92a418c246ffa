"""The source has one rank start-up: only the rank builder makes a rank's pieces, and
no engine code defines a class inside a function."""

import ast
import pathlib

import fleetserve

SRC = pathlib.Path(fleetserve.__file__).parent
BUILDER = "engine/rank_builder.py"


def _calls(name: str) -> set[str]:
    """Source files (relative to the package) that call ``name(...)``."""
    found = set()
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                called = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
                if called == name:
                    found.add(path.relative_to(SRC).as_posix())
    return found


def test_only_the_builder_makes_a_ranks_pieces():
    for name in ("ModelRunner", "Scheduler", "dp_schedule_rule", "dp_attention_hook", "SchedulerLoop",
                 "connect_rank_io"):
        assert _calls(name) == {BUILDER}, name


def test_every_rank_path_calls_the_builder():
    assert _calls("build_rank") == {"engine/rank_process.py", "testing/rank_engine.py", "entrypoints/engine.py"}


def test_no_class_inside_a_function_in_engine():
    nested = []
    for path in (SRC / "engine").rglob("*.py"):
        for fn in ast.walk(ast.parse(path.read_text())):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                nested += [f"{path.name}:{c.name}" for c in ast.walk(fn) if isinstance(c, ast.ClassDef)]
    assert nested == []
