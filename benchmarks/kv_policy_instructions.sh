#!/usr/bin/env bash
# Instructions per request of kv_aware's policy work (prepare, select, decorate, prefilled, release),
# counted by valgrind: deterministic, so two source trees compare to a fraction of a percent on a
# machine whose timings vary by tens of percent from minute to minute.
#
#   benchmarks/kv_policy_instructions.sh SRC BODIES.jsonl [PASSES] [kv_policy_cost.py flags...]
#   e.g. benchmarks/kv_policy_instructions.sh src /tmp/ov/bodies.jsonl 1 --loads-interval 0
#
# SRC: the tree's src folder (it must hold fleetserve/; the JSON names the folder the run imported).
# BODIES: as for kv_policy_cost.py (the stick's bodies; every prompt short enough to tokenize inline).
# Runs kv_policy_cost.py --callgrind under callgrind, collecting only inside functools.reduce (the
# measured passes), with a fixed hash seed and one tokenizer thread; prints instructions per request.
# Needs valgrind (apt-get install valgrind); about 1-2 minutes per pass of 200 bodies.
# The JSON's hot_path says whether the router modules ran compiled (router/compiled.py): a tree exported with
# `git archive` has no compiled modules, so compare two trees with FLEETSERVE_PURE_PYTHON=1 (both from source)
# unless both were built.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if (( $# < 2 )); then
  echo "usage: $0 SRC BODIES.jsonl [PASSES] [kv_policy_cost.py flags...]" >&2; exit 2
fi
command -v valgrind >/dev/null || { echo "$0: needs valgrind (apt-get install valgrind)" >&2; exit 2; }
[[ -d "$1/fleetserve" ]] || { echo "$0: $1 is not a src folder (no fleetserve/ in it)" >&2; exit 2; }
[[ -r "$2" ]] || { echo "$0: cannot read the bodies file $2" >&2; exit 2; }
SRC="$(cd "$1" && pwd)"; BODIES="$2"; PASSES="${3:-1}"; shift $(( $# < 3 ? $# : 3 ))
PYTHON="${PYTHON:-$HERE/../.venv/bin/python}"
if ! out=$(PYTHONHASHSEED=0 RAYON_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false PYTHONPATH="$SRC" \
      valgrind --tool=callgrind --toggle-collect=functools_reduce --callgrind-out-file=/dev/null \
      "$PYTHON" "$HERE/kv_policy_cost.py" "$BODIES" --callgrind --passes "$PASSES" "$@" 2>&1); then
  echo "$0: the measured run failed:" >&2; grep -v "^==[0-9]*==" <<<"$out" | tail -5 >&2; exit 1
fi
total=$(grep -o "Collected : [0-9]*" <<<"$out" | grep -o "[0-9]*" || true)
run=$(grep '^{"fleetserve"' <<<"$out" || true)
[[ -n "$total" && -n "$run" ]] || { echo "$0: no count from callgrind:" >&2; tail -20 <<<"$out" >&2; exit 1; }
SRC_RUN="$run" TOTAL="$total" FLAGS="$*" "$PYTHON" -c '
import json, os
run = json.loads(os.environ["SRC_RUN"])
n = run["bodies"] * run["passes"]
print(json.dumps({"fleetserve": run["fleetserve"], "hot_path": run["hot_path"], "passes": run["passes"], "requests": n,
                  "flags": os.environ["FLAGS"], "instructions_per_request": int(os.environ["TOTAL"]) // n}))'
