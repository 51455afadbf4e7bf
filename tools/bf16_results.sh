#!/usr/bin/env bash
# Regenerates results/bf16-sweep.{json,md} and its decode and training parts (issue 31): every model
# with a bf16 form (`xfbench list --format json`: dtypes holds bf16) at N = 4K and 16K in f32 and bf16,
# forward non-causal and causal; the decoding ones at a 16K context (causal, 64 steps); the training
# step at 4K; the encoder layer (vanilla, switch, gshard) forward and training at 4K; then the bf16/f32
# ratio tables (tools/bf16_ratios.py) and the models without a bf16 form.
#   tools/bf16_results.sh [XFBENCH [SWEEP OPTIONS…]]   (default build/release/xfbench; the options,
#   e.g. --min-reps 3 --min-time 0.2, go to every sweep; with those, ~7 min for 18 models on 2 cores
#   of the Zen 5 class, ~26 min for 29 on the Zen 4 class)
# Environment: BF16_RESULTS_DIR (default results) is where the six files go; BF16_MODELS (a comma
# list) limits the sweeps to those of the bf16 models.
set -euo pipefail
cd "$(dirname "$0")/.."
x=${1:-build/release/xfbench}
shift $(($# > 0 ? 1 : 0))
out=${BF16_RESULTS_DIR:-results}
mkdir -p "$out"
export BF16_MODELS=${BF16_MODELS:-}
listing=$($x list --format json)
bf16_models() {  # the bf16 models (decoding ones only with "decodes"), as a comma list
  python3 -c 'import json, os, sys
wanted = set(filter(None, os.environ["BF16_MODELS"].split(",")))
print(",".join(r["name"] for r in json.load(sys.stdin) if "bf16" in r["dtypes"] and (not wanted or r["name"] in wanted)
               and not r["ffn"] and (sys.argv[1] != "decodes" or r["decodes"])))' "$1" <<<"$listing"
}
models=$(bf16_models all)
decoders=$(bf16_models decodes)
without=$(python3 -c 'import json, sys
print(", ".join("`" + r["name"] + "`" for r in json.load(sys.stdin) if r["implemented"] and "bf16" not in r["dtypes"]))' \
  <<<"$listing")
common=(--batch 1 --heads 8 --head-dim 64 --threads 2 --dtype f32,bf16 --no-table "$@")
$x sweep --models "$models" --seq-lens 4096,16384 "${common[@]}" --out "$out/bf16-sweep.json"
$x sweep --models "$models" --seq-lens 4096,16384 --causal "${common[@]}" --out "$out/bf16-sweep-causal.json"
$x sweep --models "$decoders" --seq-lens 16384 --causal --pass decode --decode-tokens 64 "${common[@]}" \
  --out "$out/bf16-decode.json"
$x sweep --models "$models" --seq-lens 4096 --pass train "${common[@]}" --out "$out/bf16-train.json"
# The encoder layer (dense FFN around vanilla; Switch and GShard), forward and training step at 4K.
$x sweep --models vanilla,switch,gshard --scope layer --seq-lens 4096 --pass forward,train "${common[@]}" \
  --out "$out/bf16-layer.json"
{
  echo "# bf16 against f32 (issue 31)"
  echo
  python3 - "$out/bf16-sweep.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))["context"]
print("Machine: {cpu_model} ({logical_cores} shared cores, {threads} threads; kernels {kernel_isa}, bf16 kernels "
      "{bf16_kernels}, oneDNN {onednn_isa}; fp32 FMA peak {fma_peak_gflops:.0f}, bf16 dot peak "
      "{bf16_dot_peak_gflops:.0f} GFLOP/s, triad {triad_bandwidth_gbs:.0f} GB/s; commit {c}, {d}).".format(
          c=c["git_commit"][:7] + ("-dirty" if c["git_commit"].endswith("-dirty") else ""), d=c["date"][:10], **c))
PY
  echo
  echo "B=1 H=8 D=64, 2 threads. Ratios are bf16/f32 of the median time and of the tracked peak memory"
  echo "(inputs, output, workspace, state); < 1 is faster or smaller. Points of one model ran one after"
  echo "the other in one sweep (not interleaved: \`xfbench ab --b-dtype bf16\` gives interleaved ratios)."
  for part in "forward, non-causal:bf16-sweep" "forward, causal:bf16-sweep-causal" \
              "decode at a 16K context (time per step; state bytes in the note):bf16-decode" \
              "training step at 4K:bf16-train" "encoder layer (--scope layer) at 4K:bf16-layer"; do
    echo
    echo "## ${part%%:*}"
    echo
    python3 tools/bf16_ratios.py "$out/${part##*:}.json"
  done
  echo
  if [ -n "$without" ]; then
    echo "Models without a bf16 form yet (their bf16 points are \`unsupported\` rows): $without."
  else
    echo "Every model has a bf16 forward and backward (and a bf16 decode where it decodes); any bf16 row that did not run is listed above with its reason."
  fi
} >"$out/bf16-sweep.md"
echo "wrote $out/bf16-sweep.md"
