#!/usr/bin/env bash
# A/B on the router-overhead stick: sglang-router cache_aware vs fleetserve kv_aware from this checkout
# ("kv-new") and from another source tree ("kv-base", e.g. `git archive <commit> src | tar -x -C /tmp/base`),
# interleaved in one run (each repeat runs every target in turn).
#
#   BASE_SRC=/tmp/base/src benchmarks/router_kv_ab.sh OUT_DIR [DURATION_S] [REPEATS]
#
# Environment: ROUTER_BENCH_DIR (the stick), PYTHON (a python with fleetserve's dependencies),
# TOKENIZER (a tokenizer folder; default: the built-in model's).
# This checkout's router modules run compiled when setup.sh built them (router/compiled.py) and an exported
# tree's from source: export FLEETSERVE_PURE_PYTHON=1 to run both from source, or build both alike.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
SRC="$(cd "$HERE/../src" && pwd)"
STICK="${ROUTER_BENCH_DIR:-$HERE/../../shared/bench/router-overhead}"
[[ -d "$STICK" ]] || STICK="$HERE/../../../shared/bench/router-overhead"
PY="${PYTHON:-python3}"
OUT="$1"; DUR="${2:-10}"; REP="${3:-2}"
: "${BASE_SRC:?set BASE_SRC to the src folder of the version to compare with}"
TOK="${TOKENIZER:-$(PYTHONPATH="$SRC" "$PY" -c 'from fleetserve.models.tokenizer import tokenizer_dir; print(tokenizer_dir())')}"
T="-m fleetserve.cli router --host {host} --port {port} --worker-urls {workers} --policy kv_aware --tokenizer-path $TOK"
T="$T --prometheus-host {host} --prometheus-port {metrics_port} --log-level warn"
cd "$STICK"
SKIP_INSTALL=1 ROUTER_PACKAGES="sglang-router smg" ./run_bench.sh --routers sglang-router --policies cache_aware \
  --router "kv-new=PYTHONPATH=$SRC $PY $T" --router "kv-base=PYTHONPATH=$BASE_SRC $PY $T" \
  --concurrency 16,128 --duration "$DUR" --repeats "$REP" --no-direct-k --out-dir "$OUT"
