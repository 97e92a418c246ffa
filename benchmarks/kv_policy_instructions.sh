#!/usr/bin/env bash
# Instructions per request of kv_aware's policy work (prepare, select, decorate, prefilled, release),
# counted by valgrind: deterministic, so two source trees compare to a fraction of a percent on a
# machine whose timings vary by tens of percent from minute to minute.
#
#   benchmarks/kv_policy_instructions.sh SRC BODIES.jsonl [PASSES] [kv_policy_cost.py flags...]
#   e.g. benchmarks/kv_policy_instructions.sh src /tmp/ov/bodies.jsonl 1 --loads-interval 0
#
# SRC: the tree's src folder (PYTHONPATH).  BODIES: as for kv_policy_cost.py (the stick's bodies).
# Runs kv_policy_cost.py --callgrind under callgrind, collecting only inside functools.reduce (the
# measured passes), with a fixed hash seed and one tokenizer thread; prints instructions per request.
# Needs valgrind (apt-get install valgrind); about 1-2 minutes per pass of 200 bodies.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
SRC="$(cd "$1" && pwd)"; BODIES="$2"; PASSES="${3:-1}"; shift $(( $# < 3 ? $# : 3 ))
PYTHON="${PYTHON:-$HERE/../.venv/bin/python}"
n=$(wc -l <"$BODIES")
out=$(PYTHONHASHSEED=0 RAYON_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false PYTHONPATH="$SRC" \
      valgrind --tool=callgrind --toggle-collect=functools_reduce --callgrind-out-file=/dev/null \
      "$PYTHON" "$HERE/kv_policy_cost.py" "$BODIES" --callgrind --passes "$PASSES" "$@" 2>&1)
total=$(grep -o "Collected : [0-9]*" <<<"$out" | grep -o "[0-9]*" || true)
[[ -n "$total" ]] || { echo "no count from callgrind:"; tail -20 <<<"$out"; exit 1; }
echo "{\"src\": \"$SRC\", \"passes\": $PASSES, \"requests\": $((n * PASSES)), \"flags\": \"$*\", \"instructions_per_request\": $((total / (n * PASSES)))}"
