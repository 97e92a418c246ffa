"""The router's hot path compiled with Cython (router/compiled.py, setup.py): built by the install, never
run stale, and deciding exactly as the source does."""

import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import fleetserve
from fleetserve.router import compiled

SRC = Path(fleetserve.__file__).resolve().parent.parent  # the src folder this test imported
REPO = SRC.parent
BUILT = (SRC / "fleetserve" / "router" / compiled.MANIFEST).exists()
STATUS = ("from fleetserve.router import compiled; import importlib, json\n"
          "for m in compiled.MODULES: importlib.import_module(m)\n"
          "print(json.dumps(compiled.status()))")


def _env(**extra: str) -> dict:
    """This process's environment without FLEETSERVE_PURE_PYTHON, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k != compiled.PURE_ENV}
    env.update(extra)
    return env


def _status(env_extra: dict | None = None) -> tuple[dict, str]:
    env = _env(**(env_extra or {}))
    r = subprocess.run([sys.executable, "-c", STATUS], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


def _has_compiler() -> bool:
    cc = sysconfig.get_config_var("CC") or "cc"
    return shutil.which(shlex.split(cc)[0]) is not None


def test_the_install_compiled_every_hot_path_module():
    """setup.sh's install compiles every listed module where a C compiler exists (a missing build step
    would otherwise leave the router on the slow path unnoticed); where none exists, or the install was
    told FLEETSERVE_PURE_PYTHON=1, no extension exists and every module runs from source."""
    if os.environ.get(compiled.PURE_ENV) == "1" or not _has_compiler():
        status, _ = _status()
        assert status == {m: "source: not compiled" for m in compiled.MODULES}
        return
    status, err = _status()
    assert status == {m: "compiled" for m in compiled.MODULES}, err
    manifest = json.loads((SRC / "fleetserve" / "router" / compiled.MANIFEST).read_text())
    assert sorted(manifest) == sorted(compiled.MODULES)
    for m in compiled.MODULES:
        assert manifest[m] == compiled.source_digest(str(SRC / (m.replace(".", "/") + ".py")))


def test_the_pure_python_switch_loads_every_module_from_source():
    status, _ = _status({compiled.PURE_ENV: "1"})
    why = f"{compiled.PURE_ENV}=1" if BUILT else "not compiled"  # without extensions there is nothing to pass over
    assert status == {m: f"source: {why}" for m in compiled.MODULES}


def _copy_tree(tmp_path: Path) -> Path:
    """A copy of the installed src folder (sources, extensions and manifest): a tree to break."""
    copy = tmp_path / "src"
    shutil.copytree(SRC / "fleetserve", copy / "fleetserve", ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def _run(copy: Path, code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=_env(PYTHONPATH=str(copy)), capture_output=True,
                          text=True, timeout=120)


@pytest.mark.skipif(not BUILT, reason="no compiled build in this tree")
def test_a_changed_source_runs_from_source_and_a_touched_one_stays_compiled(tmp_path):
    """An extension runs only while its source has the digest it was built from: an edit (or a checkout of
    other code) runs the new source, and the router's warning names it; a newer mtime with the same bytes
    does not matter."""
    copy = _copy_tree(tmp_path)
    via = copy / "fleetserve" / "router" / "via.py"
    via.write_text(via.read_text() + "\nEDITED_AFTER_THE_BUILD = True\n")
    route_header = copy / "fleetserve" / "router" / "route_header.py"
    os.utime(route_header, (route_header.stat().st_atime, route_header.stat().st_mtime + 3600))
    r = _run(copy, STATUS + "\nimport fleetserve.router.via as v; print(getattr(v, 'EDITED_AFTER_THE_BUILD', False))"
                            "\nprint(compiled.warning())")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    status = json.loads(lines[-3])
    assert lines[-2] == "True"  # the edited source is what runs
    assert status["fleetserve.router.via"] == "source: its source changed since it was compiled"
    assert status["fleetserve.router.route_header"] == "compiled"
    assert sum(v == "compiled" for v in status.values()) == len(compiled.MODULES) - 1
    assert lines[-1] == ("the router's hot path runs from source, slower: changed since they were compiled: via "
                         "(pip install -e . compiles them again)")
    assert r.stderr == ""  # importing warns nothing by itself (the router's start-up log does)


@pytest.mark.skipif(not BUILT, reason="no compiled build in this tree")
def test_python_never_loads_an_extension_by_itself(tmp_path):
    """The extensions' file names match no module, so only the finder loads them: a checkout of code from
    before the finder, a module taken off the list or a deleted source never runs an old build."""
    copy = _copy_tree(tmp_path)
    router = copy / "fleetserve" / "router"
    (router / "via.py").unlink()  # its extension stays
    (router / "__init__.py").write_text('"""Cache-aware HTTP load balancer."""\n')  # no finder, as before it
    r = _run(copy, "import fleetserve.router.radix_tree as t, fleetserve.router.kv_events.pending as p\n"
                   "print(t.__file__.endswith('radix_tree.py'), p.__file__.endswith('pending.py'))\n"
                   "import importlib.util; print(importlib.util.find_spec('fleetserve.router.via'))")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "True", "None"]
    assert (router / f"via{compiled.TAG}{compiled.SUFFIX}").exists()


@pytest.mark.skipif(not BUILT, reason="no compiled build in this tree")
def test_compiled_and_source_make_the_same_decisions():
    """kv_aware's decisions, cost lines, held prefixes and load terms over 300 seeded random states
    (benchmarks/kv_decisions_digest.py) hash alike compiled and from source."""
    run = ("import runpy, sys\nsys.argv = ['kv_decisions_digest.py', '--scenarios', '300']\n"
           f"runpy.run_path({str(REPO / 'benchmarks' / 'kv_decisions_digest.py')!r}, run_name='__main__')\n"
           "from fleetserve.router import compiled\n"
           "print(compiled.status()['fleetserve.router.kv_events.policy'])")
    out = {}
    for pure in ("0", "1"):
        env = dict(os.environ, **{compiled.PURE_ENV: pure})
        r = subprocess.run([sys.executable, "-c", run], env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        lines = r.stdout.strip().splitlines()
        digest = [ln for ln in lines if " decisions, digest " in ln]
        assert len(digest) == 1
        out[pure] = (digest[0], lines[-1])
    assert out["0"][1] == "compiled" and out["1"][1].startswith("source")
    assert out["0"][0] == out["1"][0]
    assert int(out["0"][0].split()[0]) > 1000  # the states did reach decisions
