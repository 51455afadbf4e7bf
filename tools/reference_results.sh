#!/usr/bin/env bash
# Regenerates results/ from a release build: the reference sweeps of every implemented model
# (non-causal, and causal for the models that decode), their tables (time, speed-up, memory,
# GFLOP/s, complexity), plots, the Long Range Arena preset against LRA's published table, and the
# taxonomy, and the HTML report of them (results/reference-report.html, with the tidy CSV of its rows).
# The CI baseline has its own script: tools/ci_regression.sh --update.
#   tools/reference_results.sh                 run the four sweeps (~30 min on 2 cores), then render
#   tools/reference_results.sh --render-only   re-render tables and plots from the committed JSON
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install_deps.sh
cmake --preset release >/dev/null
cmake --build --preset release -j 2
x=build/release/xfbench
# "<cpu> (cores, threads; kernel and oneDNN ISAs; FMA peak, triad; commit, date)." from a report's context.
machine_line() {
  python3 - "$1" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))["context"]
c["commit"], c["day"] = c["git_commit"][:7], c["date"][:10]
print("{cpu_model} ({logical_cores} shared cores, {threads} threads; kernels {kernel_isa}, oneDNN {onednn_isa}; "
      "FMA peak {fma_peak_gflops:.0f} GFLOP/s and triad {triad_bandwidth_gbs:.0f} GB/s measured in the same run; "
      "commit {commit}, {day}).".format(**c))
PY
}
sweep_args=(--models implemented --seq-lens 1024:16384:x2 --batch 1 --heads 8 --head-dim 64 --threads 2)
if [ "${1:-}" != "--render-only" ]; then
  $x sweep "${sweep_args[@]}" --no-table --out results/reference-sweep.json
  $x sweep "${sweep_args[@]}" --causal --no-table --out results/reference-sweep-causal.json
  $x sweep --preset lra --threads 2 --no-table --out results/lra-sweep.json
  $x sweep --models all --seq-lens 1024:16384:x2 --pass decode --decode-tokens 200 --memory-limit 12 --threads 2 \
    --no-table --out results/decode-sweep.json
fi
# decode-sweep.md is written by hand around its tables (the targets and their reading).
$x plot results/decode-sweep.json --out results/decode-time.svg
$x plot results/decode-sweep.json --metric state --out results/decode-state.svg
# The hand-written analysis at the end of lra-sweep.md (from its first "## " heading) is kept.
lra_analysis=$(sed -n '/^## /,$p' results/lra-sweep.md 2>/dev/null || true)
{
  echo "# Long Range Arena preset"
  echo
  echo "\`xfbench sweep --preset lra --threads 2\` (layer scope, B=32, 4 heads of 64, d_ff 1024) against"
  echo "LRA's published speed and memory ratios (\`xfbench table --paper lra\`), on"
  machine_line results/lra-sweep.json
  echo
  $x table results/lra-sweep.json --paper lra --format md
  if [ -n "$lra_analysis" ]; then
    echo
    echo "$lra_analysis"
  fi
} >results/lra-sweep.md.new
mv results/lra-sweep.md.new results/lra-sweep.md
for variant in reference-sweep reference-sweep-causal; do
  json=results/$variant.json
  {
    echo "# Reference sweep ($([ "$variant" = reference-sweep ] && echo non-causal || echo causal))"
    echo
    echo "\`xfbench sweep ${sweep_args[*]}$([ "$variant" = reference-sweep-causal ] && echo ' --causal')\` on"
    machine_line "$json"
    echo "Times are medians on a shared machine (ratios are more telling than absolute figures); tracked"
    echo "memory and FLOPs are exact. Models that cannot decode are \`unsupported\` in the causal sweep."
    echo "The exact command line is the JSON's \`context.command_line\`."
    for metric in time speedup memory gflops crossover front; do
      echo
      $x table "$json" --metric "$metric" --format md
    done
    echo
    echo "**Complexity** (\`xfbench complexity\`)"
    echo
    $x complexity "$json" --format md
  } >"results/$variant.md"
done
for metric in time memory speedup; do
  $x plot results/reference-sweep.json --metric "$metric" --out "results/reference-$metric.svg"
done
$x plot results/reference-sweep.json --metric gflops --out results/reference-gflops.svg
# One page people can open: both reference sweeps and the decode sweep, every table, plot and warning.
$x report results/reference-sweep.json results/reference-sweep-causal.json results/decode-sweep.json \
  --csv results/reference-rows.csv --out results/reference-report.html
$x taxonomy --format md >results/taxonomy.md
$x taxonomy --format svg --out results/taxonomy.svg
echo "results/ regenerated"
