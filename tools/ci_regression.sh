#!/usr/bin/env bash
# CI regression gate: runs a small sweep of every implemented model and compares it with the
# committed baseline on the deterministic metrics (peak tracked memory and executed FLOPs), so it
# is reliable on shared, noisy CI machines; time is reported, not gated. Exit 0: no regression;
# 1: a regression (the comparison table says which point); 2: bad input; 3: runtime error.
#
# Portable across x86-64 machines: the project's own tracked bytes (peak_owned_bytes) and the
# FLOP counts are compared exactly everywhere; oneDNN's scratchpad (inside peak_tensor_bytes) is
# compared only where oneDNN runs the baseline's ISA. The baseline is written with oneDNN held to
# AVX2 (ONEDNN_MAX_CPU_ISA=AVX2), which every supported machine can run: CTest runs the gate once
# so (full comparison) and once unrestricted (ci.regression.native).
#
#   tools/ci_regression.sh [XFBENCH] [BASELINE]     check (defaults: build/dev/xfbench,
#                                                   results/ci-baseline.json)
#   tools/ci_regression.sh --keep NEW.json ...      check, and keep the new sweep's report
#   tools/ci_regression.sh --new NEW.json ...       check a kept report instead of sweeping
#   ONEDNN_MAX_CPU_ISA=AVX2 tools/ci_regression.sh --update [XFBENCH]
#                                                   rewrite the baseline after an intended change
#
# The baseline records the points of the models implemented when it was written; points of newer
# models show up as `new` (not a failure) until the baseline is regenerated. Baseline points the
# new sweep lacks (`missing`: a default parameter changed, or a model no longer runs) fail.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
update=0
keep=""
given=""
usage_error() {
  echo "ci_regression.sh: $1" >&2
  exit 2
}
while [ $# -gt 0 ]; do
  case "$1" in
    --update) update=1 ;;
    --keep | --new)
      [ $# -ge 2 ] || usage_error "$1 needs a file"
      if [ "$1" = "--keep" ]; then keep="$2"; else given="$2"; fi
      shift
      ;;
    *) break ;;
  esac
  shift
done
[ "$update" -eq 0 ] || [ -z "$given" ] || usage_error "--update records a sweep of its own, not --new's report"
bin="${1:-$root/build/dev/xfbench}"
baseline="${2:-$root/results/ci-baseline.json}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# Small, fixed problems: a size below, at and above common block sizes, two threads (the oneDNN
# scratchpad depends on the thread count), one quick repetition (time is not gated here).
if [ -n "$given" ]; then
  cp "$given" "$work/new.json" || exit 2
else
  "$bin" -q sweep --models implemented --seq-lens 64,100,257 --heads 2 --head-dim 16 --threads 2 --seed 42 \
    --warmup 1 --min-reps 1 --min-time 0 --no-measure --no-table --out "$work/new.json" 2>"$work/sweep.err" || {
    cat "$work/sweep.err" >&2
    exit 3
  }
  if [ -n "$keep" ]; then cp "$work/new.json" "$keep" || exit 2; fi
fi
if [ "$update" -eq 1 ]; then
  if [ "${ONEDNN_MAX_CPU_ISA:-}" != "AVX2" ]; then
    echo "ci_regression.sh --update: run with ONEDNN_MAX_CPU_ISA=AVX2 (the baseline's ISA)" >&2
    exit 2
  fi
  cp "$work/new.json" "$baseline"
  echo "baseline written to $baseline"
  exit 0
fi
# With --metrics memory,flops, compare requires the same thread count only (CPU model and build
# type do not change tracked bytes or FLOPs) and notes when the scratchpad is not compared.
# --fail-on-missing: a baseline point the new sweep lacks (a model's resolved parameters changed,
# or it stopped running) fails the gate instead of dropping out of the comparison unseen.
"$bin" compare "$baseline" "$work/new.json" --metrics memory,flops --fail-on-missing --format md
