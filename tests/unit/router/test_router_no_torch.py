"""The router must never import torch (it runs on machines without it)."""

import subprocess
import sys


def test_router_modules_do_not_import_torch():
    code = ("import sys; import fleetserve.router.cli, fleetserve.router.app, "
            "fleetserve.router.metrics, fleetserve.router.health; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
