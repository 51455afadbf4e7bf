#!/usr/bin/env bash
# Regenerates results/ from a release build: the reference sweep of every implemented model, its
# tables (time, speed-up, memory, GFLOP/s, complexity), its plots, and the taxonomy. Arguments
# are passed to the sweep (e.g. --seq-lens 512:8192:x2). The CI baseline has its own script:
# tools/ci_regression.sh --update.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install_deps.sh
cmake --preset release >/dev/null
cmake --build --preset release
x=build/release/xfbench
out=results/reference-sweep
$x sweep --models implemented --seq-lens 256:4096:x2 --threads 2 --no-table --out "$out.json" "$@"
{
  echo "# Reference sweep"
  echo
  echo "\`xfbench sweep --models implemented --seq-lens 256:4096:x2 --threads 2 $*\` on 2 shared cores of an"
  echo "AMD EPYC (Zen 3, AVX2); times are noisy on this shared machine, tracked memory and FLOPs are exact."
  for metric in time speedup memory gflops; do
    echo
    $x table "$out.json" --metric "$metric" --format md
  done
  echo
  echo "**Complexity** (\`xfbench complexity\`)"
  echo
  $x complexity "$out.json" --format md
} >"$out.md"
for metric in time memory speedup; do
  $x plot "$out.json" --metric "$metric" --out "results/reference-$metric.svg"
done
$x taxonomy --format md >results/taxonomy.md
$x taxonomy --format svg --out results/taxonomy.svg
echo "results/ regenerated"
