#!/usr/bin/env bash
# Profile `fleetserve router` under wrk load with py-spy (the stick's fake workers and wrk script).
#
#   benchmarks/router_profile.sh BODIES.jsonl [router flags...]
#   e.g. benchmarks/router_profile.sh /tmp/fleetserve-router-overhead/bodies.jsonl \
#            --policy kv_aware --tokenizer-path ~/.cache/fleetserve/tokenizers/<hash>
#
# 4 fake workers and the router on cpu1, wrk (1 thread, 16 connections, 14 s) on cpu0, as the stick
# pins them (CONC=N: N connections); py-spy samples the router for 10 s at 200 Hz and writes collapsed stacks to $OUT
# (default /tmp/router-profile.raw), then the top frames by own and total samples are printed.
# Environment: ROUTER_BENCH_DIR (the stick), PYSPY (py-spy binary; default /tmp/peers/bin/py-spy),
# PEERS_PY (python with uvloop/orjson for the fake workers; default /tmp/peers/bin/python), PYTHON.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
STICK="${ROUTER_BENCH_DIR:-$HERE/../../shared/bench/router-overhead}"
[[ -d "$STICK" ]] || STICK="$HERE/../../../shared/bench/router-overhead"
PYSPY="${PYSPY:-/tmp/peers/bin/py-spy}"
PEERS_PY="${PEERS_PY:-/tmp/peers/bin/python}"
PYTHON="${PYTHON:-python3}"
OUT="${OUT:-/tmp/router-profile.raw}"
BODIES="$1"; shift
read -r -a PORTS <<<"$("$PYTHON" -c "
import socket
ss = [socket.socket() for _ in range(6)]
for s in ss: s.bind(('127.0.0.1', 0))
print(' '.join(str(s.getsockname()[1]) for s in ss))")"
PIDS=()
URLS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT
for i in 0 1 2 3; do
  taskset -c 1 "$PEERS_PY" "$STICK/fake_worker.py" --port "${PORTS[$i]}" --max-lifetime-s 120 >/dev/null 2>&1 &
  PIDS+=($!)
  URLS+=("http://127.0.0.1:${PORTS[$i]}")
done
sleep 2
taskset -c 1 "$PYTHON" -m fleetserve.cli router --host 127.0.0.1 --port "${PORTS[4]}" --worker-urls "${URLS[@]}" \
  --prometheus-host 127.0.0.1 --prometheus-port "${PORTS[5]}" --log-level warn "$@" >/tmp/router-profile.log 2>&1 &
RP=$!
PIDS+=($RP)
for _ in $(seq 1 120); do
  code=$(curl -s -m 5 -o /dev/null -w "%{http_code}" -X POST -d "$(head -1 "$BODIES")" \
         "http://127.0.0.1:${PORTS[4]}/v1/completions" || true)
  [[ "$code" == 200 ]] && break
  sleep 0.5
done
WRK_BODIES="$BODIES" WRK_PATH=/v1/completions timeout 30 taskset -c 0 wrk -t1 -c"${CONC:-16}" -d14s \
  -s "$STICK/wrk_post.lua" "http://127.0.0.1:${PORTS[4]}" >/tmp/router-profile-wrk.log 2>&1 &
WP=$!
sleep 2
timeout 20 "$PYSPY" record -p "$RP" -d 10 -r 200 -f raw -o "$OUT" >/dev/null 2>&1
wait "$WP" || true
grep -E "Requests/sec" /tmp/router-profile-wrk.log || true
"$PYTHON" - "$OUT" <<'PY'
import sys
from collections import Counter
own, total_of, total = Counter(), Counter(), 0
for line in open(sys.argv[1]):
    stack, n = line.rstrip().rsplit(" ", 1)
    n = int(n)
    total += n
    frames = stack.split(";")
    own[frames[-1]] += n
    for f in set(frames):
        total_of[f] += n
print(f"{total} samples")
for name, c in (("own", own), ("total", total_of)):
    for f, n in c.most_common(15):
        print(f"{n / total * 100:5.1f}% {name:5s} {f}")
PY
