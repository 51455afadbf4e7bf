#!/usr/bin/env bash
# The trustworthy-figures benchmarks, under a documented background load: one busy shell loop
# (`while :; do :; done`) for the length of each loaded run. Writes into results/trust/:
#   quiet.json, loaded.json, quiet-after.json   sweep of every model at N = 512, 1K, 2K: quiet,
#                                                under the load, quiet again
#   power-K.json (K = 1…10)                     ab of local block 50 against block 68 at N = 4096
#                                                (+13% time quiet), under the load
#   aa-K.json (K = 1…RUNS)                      ab of this build against itself over every model
#                                                at N = 512, 1K, 2K, under the load
#   tools/trust_benchmarks.sh [XFBENCH] [RUNS]  (defaults: build/release/xfbench, 10; one A/A run
#                                                takes ~13 min on 2 cores under the load)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bin="${1:-$root/build/release/xfbench}"
runs="${2:-10}"
out="$root/results/trust"
mkdir -p "$out"
load_pid=""
start_load() { bash -c 'while :; do :; done' & load_pid=$!; sleep 1; }
stop_load() { kill "$load_pid"; load_pid=""; }
trap '[ -n "$load_pid" ] && kill "$load_pid"' EXIT

sweep=(--models implemented --seq-lens 512,1024,2048 --threads 2 --min-time 0.2 --no-measure --no-table)
"$bin" sweep "${sweep[@]}" --out "$out/quiet.json" 2>/dev/null
start_load
"$bin" sweep "${sweep[@]}" --out "$out/loaded.json" 2>/dev/null
stop_load
"$bin" sweep "${sweep[@]}" --out "$out/quiet-after.json" 2>/dev/null

power=(--models local --seq-lens 4096 --a-param block=50 --b-param block=68 --threads 2 --rounds 10)
"$bin" ab "${power[@]}" 2>/dev/null | sed -n 3p || true  # the quiet ratio, for reference
start_load
for k in $(seq 1 10); do "$bin" ab "${power[@]}" --out "$out/power-$k.json" 2>/dev/null | sed -n 3p || true; done
for k in $(seq 1 "$runs"); do
  "$bin" ab --models implemented --seq-lens 512,1024,2048 --threads 2 --rounds 10 --min-time 0.05 \
    --out "$out/aa-$k.json" 2>/dev/null | tail -1 || true
done
stop_load
