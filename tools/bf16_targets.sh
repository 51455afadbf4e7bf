#!/usr/bin/env bash
# Issue 31's targets, measured: interleaved `xfbench ab --b-dtype bf16` (f32 as side A, bf16 as B) of
# exact-tiled's forward at 4K and 16K, vanilla's and exact-tiled's decoding at a 16K context, the
# exact-tiled training step at 4K and the forward of local, performer, linear-transformer and
# reformer at 8K, plus a bf16 sweep of exact-tiled for its share of the bf16 peak; the reports go to
# results/bf16-targets/ and the summary (tools/bf16_targets.py) to results/bf16-targets.md (under
# $BF16_RESULTS_DIR instead of results/ when it is set).
#   tools/bf16_targets.sh [XFBENCH [ROUNDS]]   (default build/release/xfbench, 6 rounds; ~10 min on
#   2 cores of the Zen 5 class). Run it on a quiet machine: nothing else may run meanwhile.
set -euo pipefail
cd "$(dirname "$0")/.."
x=${1:-build/release/xfbench}
rounds=${2:-6}
dir=${BF16_RESULTS_DIR:-results}  # where bf16-targets/ and bf16-targets.md go
out=$dir/bf16-targets
mkdir -p "$out"
common=(--batch 1 --heads 8 --head-dim 64 --threads 2 --b-dtype bf16 --rounds "$rounds" --max-slowdown 5%)
# ab exits 1 when B is slower (a "regression" verdict): a measured answer here, not a failure.
ab() { "$x" ab "$@" >/dev/null || [ $? -eq 1 ]; }
ab --models exact-tiled --seq-lens 4096,16384 "${common[@]}" --out "$out/ab-forward.json"
ab --models vanilla,exact-tiled --seq-lens 16384 --causal --pass decode --decode-tokens 64 "${common[@]}" \
  --out "$out/ab-decode.json"
ab --models exact-tiled --seq-lens 4096 --pass train "${common[@]}" --out "$out/ab-train.json"
ab --models local,performer,linear-transformer,reformer --seq-lens 8192 "${common[@]}" --out "$out/ab-8k.json"
$x sweep --models exact-tiled --seq-lens 4096,16384 --batch 1 --heads 8 --head-dim 64 --threads 2 --dtype bf16 \
  --no-table --out "$out/gflops.json"
{
  echo "# bf16 targets of issue 31"
  echo
  python3 tools/bf16_targets.py "$out"
  echo
  echo "B=1 H=8 D=64, 2 threads; each ratio from one interleaved \`ab\` run of $rounds A B | B A rounds"
  echo "($out/*.json hold every round). The decode targets were set where the triad is"
  echo "~75 GB/s; the machine line gives this one's."
} >"$dir/bf16-targets.md"
echo "wrote $dir/bf16-targets.md"
