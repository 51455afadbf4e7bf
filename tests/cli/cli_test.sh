#!/usr/bin/env bash
# End-to-end tests of the xfbench command line: exit codes, one-line errors, no partial output,
# run/sweep/table/list/env behaviour, child-process isolation, resume and memory-limit skips;
# compare on doctored reports, shards and merge, plot, complexity, taxonomy, the LRA preset, the
# report schema document against the fields reports carry and the layer check. The CI regression gate
# has its own: tests/cli/ci_gate_test.sh.
set -u
bin="$1"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0
passes=0
src="$(cd "$(dirname "$0")/../.." && pwd)"

pass() { passes=$((passes + 1)); }
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

# expect_error CODE ARGS...: exits with CODE, prints exactly one stderr line, nothing on stdout.
expect_error() {
  local code=$1
  shift
  "$bin" "$@" >"$work/out" 2>"$work/err"
  local got=$?
  local lines
  # An unoptimised (sanitizer) build adds its warning line; the error itself must be one line.
  lines=$(grep -vc "this build is not optimised" "$work/err" || true)
  if [ "$got" -ne "$code" ]; then
    fail "xfbench $* exited $got, want $code ($(head -c 300 "$work/err"))"
  elif [ "$lines" -ne 1 ]; then
    fail "xfbench $* printed $lines stderr lines, want 1: $(cat "$work/err")"
  elif [ -s "$work/out" ]; then
    fail "xfbench $* printed to stdout on error"
  else
    pass
  fi
}

quick=(--heads 2 --head-dim 16 --min-reps 2 --min-time 0 --threads 2)

# --- bad input: exit 2, one line, no output file ---------------------------------------------
expect_error 2 run --model nosuch --seq-len 64
expect_error 2 run --model vanilla --seq-len 0
expect_error 2 run --model vanilla --seq-len -5
expect_error 2 run --model vanilla --seq-len abc
expect_error 2 run --model vanilla --seq-len 64 --heads 0
expect_error 2 run --model vanilla --seq-len 64 --param nosuch=1
expect_error 2 run --model exact-tiled --seq-len 64 --param block_q=0
expect_error 2 run --model exact-tiled --seq-len 64 --param block_q=abc
expect_error 2 run --model vanilla --seq-len 64 --scope nosuch
expect_error 2 run --model vanilla --seq-len 64 --warmup 0
expect_error 2 run --model vanilla --seq-len 64 --dump "$work/missing/deeper/dir"
expect_error 2 run --model vanilla --seq-len 64 --dump ""
# A symbolic link, even to an empty folder, cannot take the finished dump's rename: said so.
mkdir -p "$work/empty-target" && ln -s "$work/empty-target" "$work/dump-link"
expect_error 2 run --model vanilla --seq-len 64 --dump "$work/dump-link"
grep -q "is a symbolic link" "$work/err" && pass || fail "--dump onto a link: $(cat "$work/err")"
# The project's own variables are checked on every CPU class, with one line naming the variable.
for setting in "XFBENCH_MAX_ISA=avx9" "XFBENCH_MAX_ISA=avx2 " "XFBENCH_BF16_DOT=yes"; do
  env "$setting" "$bin" run --model vanilla --seq-len 64 --dtype bf16 --heads 1 --head-dim 16 --min-reps 1 \
    --min-time 0 >/dev/null 2>"$work/err"
  code=$?
  [ "$code" -eq 2 ] && [ "$(grep -vc "this build is not optimised" "$work/err")" -eq 1 ] \
    && grep -q "${setting%%=*}" "$work/err" && pass || fail "$setting (exit $code): $(cat "$work/err")"
done
# The default --threads comes from OMP_NUM_THREADS: out of range, the message names the variable
# (99999999999 wraps in libgomp), and --threads given in range overrides it.
for threads in 5000 99999999999; do
  OMP_NUM_THREADS=$threads expect_error 2 run --model vanilla --seq-len 64
  grep -q "OMP_NUM_THREADS=$threads gives" "$work/err" && pass || fail "OMP_NUM_THREADS=$threads: $(cat "$work/err")"
done
OMP_NUM_THREADS=5000 "$bin" run --model vanilla --seq-len 64 --heads 1 --head-dim 16 --min-reps 1 --min-time 0 \
  --threads 1 >/dev/null 2>&1 && pass || fail "--threads 1 overrides an out-of-range OMP_NUM_THREADS"
# A value OpenMP ignores (it falls back to the cores) is refused too; libgomp's own warning line,
# printed before main, is left out of the count. A list's first count and spaces are read as libgomp does.
for threads in 0 -1 abc 1x ""; do
  OMP_NUM_THREADS=$threads "$bin" run --model vanilla --seq-len 64 >"$work/out" 2>"$work/err"
  code=$?
  [ "$code" -eq 2 ] && [ "$(grep -v "^libgomp:\|this build is not optimised" "$work/err" | grep -c .)" -eq 1 ] \
    && grep -q "OMP_NUM_THREADS=$threads is not a thread count" "$work/err" \
    && pass || fail "OMP_NUM_THREADS='$threads' (exit $code): $(cat "$work/err")"
done
for threads in "1,1" " 1 "; do
  OMP_NUM_THREADS=$threads "$bin" run --model vanilla --seq-len 16 --heads 1 --head-dim 16 --min-reps 1 --min-time 0 \
    >/dev/null 2>&1 && pass || fail "OMP_NUM_THREADS='$threads' is a count libgomp reads"
done
expect_error 2 list --class ""
# A team of threads that cannot start (1000 stacks of 8 MiB past an 8 GB address space) is a
# runtime error on one line, not libgomp's exit. Not under the sanitizers (a Debug build), whose
# shadow memory needs more address space than any such limit allows.
if ! "$bin" --version | grep -q "Debug build"; then
  (ulimit -s 8192 -v 8000000; "$bin" run --model local --seq-len 64 --heads 1 --head-dim 16 --min-reps 1 --min-time 0 \
    --threads 1000 >/dev/null 2>"$work/err")
  code=$?
  [ "$code" -eq 3 ] && [ "$(wc -l <"$work/err")" -eq 1 ] && grep -q "cannot start 1000 threads" "$work/err" && pass \
    || fail "--threads 1000 under ulimit -v (exit $code): $(cat "$work/err")"
fi
# A dump that fails to write (file size limit): exit 3, one stderr line, neither the folder nor its
# temporary sibling left.
(ulimit -f 1; "$bin" run --model local --seq-len 64 "${quick[@]}" --dump "$work/limited" >/dev/null 2>"$work/err")
code=$?
[ "$code" -eq 3 ] && [ "$(grep -vc "this build is not optimised" "$work/err")" -eq 1 ] \
  && [ -z "$(find "$work" -maxdepth 1 -name 'limited*')" ] && pass \
  || fail "a dump past the file size limit (exit $code): $(cat "$work/err"); $(ls -d "$work"/limited* 2>/dev/null)"
expect_error 2 sweep --models vanilla --seq-lens 64 --out "$work/missing/r.json"
[ ! -e "$work/missing" ] && pass || fail "a folder was created for a bad --out"
expect_error 2 sweep --models nosuch --seq-lens 64 --out "$work/r.json"
expect_error 2 sweep --models vanilla --seq-lens 0 --out "$work/r.json"
expect_error 2 sweep --models vanilla --seq-lens 64:32:x2 --out "$work/r.json"
expect_error 2 sweep --models vanilla --seq-lens 64 --param block_q=8 --out "$work/r.json"
[ ! -e "$work/r.json" ] && pass || fail "a report file was written for bad input"
# Constraints between a model's values and the problem are checked before anything runs.
expect_error 2 sweep --models longformer --seq-lens 64 --param window=7 --out "$work/r.json"
expect_error 2 sweep --models linformer --seq-lens 64,512 --param projection=identity --param k=100 --out "$work/r.json"
expect_error 2 run --model reformer --seq-len 64 --param n_buckets=5
expect_error 2 run --model sparse-transformer --seq-len 64 --param pattern=fixed --param stride=4 --param summary=5
[ ! -e "$work/r.json" ] && pass || fail "a report file was written for a model's bad combination"

# --threads below the core count: per-thread buffers, the estimate and the row follow it (one
# thread's 64 × 64 score tile and row statistics, 16896 B, and its key panels for hulls of ≤ 64
# keys, 4 panels × 16 × 64 floats = 16384 B).
"$bin" run --model local --seq-len 1024 --threads 1 --min-reps 1 --min-time 0 --json >"$work/t1.json" 2>/dev/null &&
  python3 -c 'import json, sys; r = json.load(open(sys.argv[1]))
assert r["threads"] == 1 and r["estimated_workspace_bytes"] == r["workspace_bytes"] == 16896 + 16384, r' "$work/t1.json" \
  && pass || fail "run --threads 1: estimate, tracked workspace and threads of the row"
expect_error 2 table "$work/nosuch.json"
echo "{ broken" >"$work/broken.json"
expect_error 2 table "$work/broken.json"
echo '{"schema_version": 999, "results": []}' >"$work/future.json"
expect_error 2 table "$work/future.json"
expect_error 2 list --class nosuch
expect_error 2 nosuchcommand
expect_error 2

# --- run ---------------------------------------------------------------------------------------
"$bin" run --model exact-tiled --seq-len 100 "${quick[@]}" --json >"$work/run.json" 2>"$work/err" \
  && grep -q '"status":"ok"' "$work/run.json" \
  && grep -Eq '"reproducer":"(XFBENCH_MAX_ISA=[a-z0-9]+ )?xfbench run --model exact-tiled' "$work/run.json" \
  && pass || fail "run --json: $(cat "$work/err")"
"$bin" run --model exact-tiled --seq-len 100 "${quick[@]}" >"$work/run.txt" && grep -q "^median" "$work/run.txt" \
  && pass || fail "run prints a human summary"
# One sample has a CV of 0 that says nothing: the row is unstable (~ in tables), not steady.
"$bin" run --model exact-tiled --seq-len 100 --heads 2 --head-dim 16 --min-reps 1 --max-reps 1 --min-time 0 --json \
  >"$work/single.json" 2>/dev/null && grep -q '"samples_ns":\[[0-9.e+]*\]' "$work/single.json" \
  && grep -q '"unstable":true' "$work/single.json" && pass || fail "a single-sample row is not marked unstable"
# The reproducer line reruns the same point.
# (Under XFBENCH_MAX_ISA the reproducer starts with that assignment, which this environment already has.)
reproducer=$(sed -n 's/.*"reproducer":"[^"]*xfbench \([^"]*\)".*/\1/p' "$work/run.json")
# shellcheck disable=SC2086
"$bin" $reproducer --json >"$work/rerun.json" && grep -q '"flops":' "$work/rerun.json" \
  && [ "$(grep -o '"flops":[0-9]*' "$work/run.json")" = "$(grep -o '"flops":[0-9]*' "$work/rerun.json")" ] \
  && pass || fail "the reproducer does not rerun the point"
"$bin" run --model linformer --seq-len 64 --causal "${quick[@]}" --json >"$work/unsupported.json"
grep -q '"status":"unsupported"' "$work/unsupported.json" && pass || fail "causal linformer (cannot decode) is not an unsupported row"
"$bin" run --model bigbird --seq-len 64 --causal "${quick[@]}" --json >"$work/causal.json"
grep -q '"status":"unsupported"' "$work/causal.json" && pass || fail "causal non-decoder is not unsupported"
# An unsupported point writes no dump, not even its folder.
"$bin" run --model bigbird --seq-len 64 --causal "${quick[@]}" --dump "$work/nodump" >/dev/null
[ ! -e "$work/nodump" ] && pass || fail "--dump of an unsupported point created $work/nodump"
"$bin" run --model vanilla --seq-len 33 "${quick[@]}" --scope layer --dump "$work/dump" >/dev/null \
  && [ -f "$work/dump/manifest.json" ] && [ -f "$work/dump/q.npy" ] && [ -f "$work/dump/out.npy" ] \
  && [ -f "$work/dump/layer_w_qkv.npy" ] && pass || fail "--dump files missing"

# --- mixture-of-experts FFN (docs/layer.md#mixture-of-experts) ------------------------------------
"$bin" run --model performer --seq-len 64 "${quick[@]}" --scope layer --ffn switch --experts 4 --json \
  >"$work/moe.json" 2>/dev/null &&
  python3 -c 'import json, sys; r = json.load(open(sys.argv[1]))
assert r["status"] == "ok" and r["model"] == "performer" and r["ffn"] == "switch" and r["experts"] == 4, r
assert r["capacity_factor"] == 1.25 and r["tokens_dropped"] >= 0 and r["expert_load"] >= 1, r
assert "--ffn switch --experts 4 --capacity-factor 1.25 --group-size 0" in r["reproducer"], r' "$work/moe.json" \
  && pass || fail "run --ffn switch with performer: row fields and reproducer"
"$bin" run --model switch --seq-len 64 "${quick[@]}" --json >"$work/moe-attention.json" 2>/dev/null &&
  python3 -c 'import json, sys; r = json.load(open(sys.argv[1]))
assert r["status"] == "unsupported" and "run with --scope layer, or --ffn switch" in r["reason"], r' \
    "$work/moe-attention.json" && pass || fail "-m switch in attention scope is not an unsupported row with the reason"
expect_error 2 run --model vanilla --seq-len 64 --ffn switch
expect_error 2 run --model vanilla --seq-len 64 --scope layer --ffn switch --experts 0
expect_error 2 run --model vanilla --seq-len 64 --scope layer --ffn gshard --capacity-factor 0
expect_error 2 run --model vanilla --seq-len 64 --scope layer --ffn gshard --capacity-factor -1
expect_error 2 run --model gshard --seq-len 64 --scope layer --ffn switch
# Mixture-of-experts layer dumps recomputed in float64 (routing, capacity, gates, out), as docs/layer.md says:
# GShard in groups of 16 rows, Switch at a capacity that drops tokens.
for spec in "gshard --group-size 16 --capacity-factor 0.75" "switch --batch 2 --experts 3 --capacity-factor 0.5"; do
  read -r model settings <<<"$spec"
  rm -rf "$work/moe-dump"
  # shellcheck disable=SC2086
  "$bin" run --model "$model" --seq-len 37 "${quick[@]}" --scope layer $settings --dump "$work/moe-dump" \
    >/dev/null 2>&1 && python3 "$src/tools/check_moe_dump.py" "$work/moe-dump" >"$work/moe-dump.txt" 2>&1 \
    && pass || fail "$model layer dump does not recompute: $(cat "$work/moe-dump.txt")"
done

# --- training passes -------------------------------------------------------------------------------
expect_error 2 run --model vanilla --seq-len 64 --pass nosuch
# A train dump holds dO and the gradients; recomputed in float64 outside the project.
for model in vanilla exact-tiled; do
  rm -rf "$work/grad"
  "$bin" run --model "$model" --seq-len 37 --causal --pass train "${quick[@]}" \
    --dump "$work/grad" >/dev/null \
    && grep -q '"pass": "train"' "$work/grad/manifest.json" \
    && python3 "$src/tools/check_gradient_dump.py" "$work/grad" >"$work/grad.txt" \
    && pass || fail "$model train dump: gradients do not match a float64 recomputation: $(cat "$work/grad.txt")"
done
"$bin" run --model exact-tiled --seq-len 100 --pass backward "${quick[@]}" --json >"$work/bwd.json" &&
  python3 -c 'import json, sys; r = json.load(open(sys.argv[1]))
assert r["pass"] == "backward" and r["saved_bytes"] == 2 * 100 * 4 and "--pass backward" in r["reproducer"], r' \
    "$work/bwd.json" && pass || fail "run --pass backward: row pass, saved_bytes, reproducer"
"$bin" run --model set-transformer --seq-len 64 --pass train "${quick[@]}" --json >"$work/isab.json" &&
  python3 -c 'import json, sys; r = json.load(open(sys.argv[1]))
assert r["status"] == "ok" and r["pass"] == "train" and r["saved_bytes"] > 0, r' "$work/isab.json" \
  && pass || fail "run --pass train: set-transformer"
"$bin" sweep --models vanilla,exact-tiled --seq-lens 64,100 --pass train "${quick[@]}" --no-measure \
  --out "$work/train.json" >"$work/train.txt" 2>/dev/null \
  && [ "$(grep -c '"pass": "train"' "$work/train.json")" -eq 5 ] && grep -q "train pass" "$work/train.txt" \
  && pass || fail "sweep --pass train: rows, settings and table"
# Decode: per-token rows, a dump recomputed outside the project, the same draws as the causal forward.
# Synthesizer and Sinkhorn are recomputed from the parameters the dump holds at N + T positions.
for spec in vanilla exact-tiled "local block=8" "image-transformer query_block=8 memory_flange=5" linear-transformer \
    "synthesizer variant=dense" "synthesizer variant=random vanilla_weight=0.25" \
    "synthesizer variant=factorized-random factor_rank=3" "sinkhorn block=3 temperature=0.5"; do
  read -r model settings <<<"$spec"
  params=()
  for setting in $settings; do params+=(--param "$setting"); done
  dir="$work/dec-${spec// /-}"
  "$bin" run --model "$model" --seq-len 37 --pass decode --decode-tokens 6 "${quick[@]}" "${params[@]}" \
    --dump "$dir" --json >"$work/dec.json" \
    && python3 "$src/tools/check_decode_dump.py" "$dir" >"$work/dec.txt" \
    && python3 -c 'import json, sys; r = json.load(open(sys.argv[1]))
assert r["status"] == "ok" and r["pass"] == "decode" and r["causal"] and r["decode_tokens"] == 6, r
assert r["state_bytes"] > 0 and r["prefill_ns"] > 0, r
assert len(r["samples_ns"]) + len(r.get("contended_samples_ns", [])) >= 6, r  # descheduled tokens kept apart
assert "--pass decode --decode-tokens 6" in r["reproducer"], r' "$work/dec.json" \
    && pass || fail "run --pass decode --dump: $spec ($(cat "$work/dec.txt" 2>/dev/null))"
done
"$bin" run --model vanilla --seq-len 43 --causal "${quick[@]}" --dump "$work/causal-43" >/dev/null \
  && cmp -s "$work/causal-43/k.npy" "$work/dec-vanilla/k.npy" && pass \
  || fail "decode dump: the sequence's inputs are the causal forward's over N + T tokens"
"$bin" run --model linformer --seq-len 64 --pass decode "${quick[@]}" --json >"$work/dec-lin.json" \
  && grep -q '"status":"unsupported"' "$work/dec-lin.json" && grep -q 'Decode = no' "$work/dec-lin.json" \
  && pass || fail "run --pass decode: a model that cannot decode gives an unsupported row"
expect_error 2 run --model vanilla --seq-len 64 --pass decode --scope layer
expect_error 2 run --model vanilla --seq-len 64 --pass decode --decode-tokens 0

# --- --dtype bf16 ----------------------------------------------------------------------------------
expect_error 2 run --model vanilla --seq-len 64 --dtype f16
expect_error 2 sweep --models vanilla --seq-lens 64 --dtype fp8 --out "$work/r.json"
"$bin" run --model vanilla --seq-len 64 --dtype bf16 --pass decode --decode-tokens 4 "${quick[@]}" --json \
  >"$work/bf16.json" && python3 -c 'import json, sys; r = json.load(open(sys.argv[1]))
assert r["status"] == "ok" and r["dtype"] == "bf16" and "--dtype bf16" in r["reproducer"], r
assert r["state_bytes"] == 2 * (80 + 68) * 16 * 2, r' "$work/bf16.json" \
  && pass || fail "run --dtype bf16: a vanilla decode row in bf16 with a bf16 KV cache (key panels of 16 tokens, value row pairs)"
rm -rf "$work/bf16-train"
"$bin" run --model vanilla --seq-len 37 --causal --pass train --dtype bf16 "${quick[@]}" --dump "$work/bf16-train" \
  >/dev/null && grep -q '"dtype": "bf16"' "$work/bf16-train/manifest.json" && [ -s "$work/bf16-train/dq.npy" ] \
  && python3 "$src/tools/check_gradient_dump.py" "$work/bf16-train" >"$work/grad.txt" \
  && pass || fail "run --pass train --dtype bf16 --dump: a vanilla training step in bf16 ($(cat "$work/grad.txt"))"
# The dump checkers in bf16 (their tolerance and the KV cache's kernel layouts: key panels, value row
# pairs), and at N = 1, where dq and dk are 0 and exact-tiled's hold rounding noise.
for spec in "vanilla 16" "exact-tiled 32" "vanilla 24" "local 16"; do
  read -r model dim <<<"$spec"
  rm -rf "$work/bf16-dec"
  "$bin" run --model "$model" --seq-len 37 --pass decode --decode-tokens 6 --dtype bf16 --heads 2 --head-dim "$dim" \
    --min-reps 1 --min-time 0 --dump "$work/bf16-dec" >/dev/null 2>&1 \
    && python3 "$src/tools/check_decode_dump.py" "$work/bf16-dec" >"$work/dec.txt" \
    && pass || fail "check_decode_dump.py on a bf16 $spec decode dump: $(cat "$work/dec.txt")"
done
# linear-transformer's bf16 state, rounded once per decoded token, within the bf16 tolerance over
# 300 tokens (it drifts past it near 1000: docs/measurement.md#bf16).
rm -rf "$work/bf16-dec"
"$bin" run --model linear-transformer --seq-len 16 --pass decode --decode-tokens 300 --dtype bf16 --heads 1 \
  --head-dim 16 --min-reps 1 --min-time 0 --dump "$work/bf16-dec" >/dev/null 2>&1 \
  && python3 "$src/tools/check_decode_dump.py" "$work/bf16-dec" >"$work/dec.txt" \
  && pass || fail "check_decode_dump.py on a 300-token bf16 linear-transformer decode: $(cat "$work/dec.txt")"
for tool in check_decode_dump check_gradient_dump check_moe_dump; do
  python3 "$src/tools/$tool.py" "$work" >/dev/null 2>"$work/tool.err"
  [ $? -eq 2 ] && grep -q "is not a dump" "$work/tool.err" && pass || fail "$tool.py on a folder without a manifest"
done
rm -rf "$work/grad-1"
"$bin" run --model exact-tiled --seq-len 1 --pass train "${quick[@]}" --dump "$work/grad-1" >/dev/null 2>&1 \
  && python3 "$src/tools/check_gradient_dump.py" "$work/grad-1" >"$work/grad.txt" \
  && pass || fail "check_gradient_dump.py at N = 1: $(cat "$work/grad.txt")"
"$bin" run --model switch --scope layer --seq-len 64 --dtype bf16 --pass train "${quick[@]}" --json \
  >"$work/bf16-switch.json" && python3 -c 'import json, sys; r = json.load(open(sys.argv[1]))
assert r["status"] == "ok" and r["dtype"] == "bf16" and r["ffn"] == "switch" and r["flops"] > 0, r
assert r["peak_owned_bytes"] - 2 * 2 * 64 * 32 * 2 == r["estimated_workspace_bytes"], r' "$work/bf16-switch.json" \
  && pass || fail "run --dtype bf16: a switch layer training step in bf16 (x, y, dy, dx bf16; the estimate exact)"
"$bin" run --model tokenlearner --scope layer --seq-len 64 --dtype bf16 --pass train "${quick[@]}" --json \
  >"$work/bf16-tokenlearner.json" && python3 -c 'import json, sys; r = json.load(open(sys.argv[1]))
assert r["status"] == "ok" and r["dtype"] == "bf16" and r["out_len"] == 8, r
assert r["peak_owned_bytes"] - (2 * 64 + 2 * 8) * 32 * 2 == r["estimated_workspace_bytes"], r' "$work/bf16-tokenlearner.json" \
  && pass || fail "run --dtype bf16: a layer training step around tokenlearner in bf16 (x, dx of 64 rows, y, dy of 8; the estimate exact)"
"$bin" sweep --models vanilla --seq-lens 64 --dtype f32,bf16 "${quick[@]}" --no-measure \
  --out "$work/bf16-grid.json" >"$work/bf16-grid.txt" 2>/dev/null \
  && python3 -c 'import json, sys; r = json.load(open(sys.argv[1]))
assert sorted(row["dtype"] for row in r["results"]) == ["bf16", "f32"], r["results"]
assert r["settings"]["dtype"] == ["f32", "bf16"], r["settings"]
assert all(("--dtype" in row["reproducer"]) == (row["dtype"] == "bf16") for row in r["results"])' \
    "$work/bf16-grid.json" && grep -q "bf16" "$work/bf16-grid.txt" \
  && pass || fail "sweep --dtype f32,bf16: a row per dtype, settings and tables apart"

# --- sweep: report, table, progress, resume, memory limit, child isolation ----------------------
# Causal: linformer cannot decode, so its rows are unsupported whatever is implemented.
"$bin" sweep --models vanilla,exact-tiled,linformer --seq-lens 64,100 "${quick[@]}" --causal --no-measure \
  --memory-limit 0.0001 --out "$work/sweep.json" >"$work/sweep.txt" 2>"$work/sweep.err"
[ $? -eq 0 ] && pass || fail "sweep failed: $(tail -3 "$work/sweep.err")"
grep -q "\[6/6\]" "$work/sweep.err" && pass || fail "sweep progress lines missing"
# -q after the command, as before it: no progress lines.
"$bin" sweep --models vanilla --seq-lens 64 "${quick[@]}" --no-measure --no-table --out "$work/quiet.json" -q \
  2>"$work/quiet.err" && ! grep -q "\[1/1\]" "$work/quiet.err" && pass || fail "sweep … -q: $(cat "$work/quiet.err")"
grep -q '"status": "skipped"' "$work/sweep.json" && pass || fail "memory-limit skip missing"
grep -q '"status": "unsupported"' "$work/sweep.json" && pass || fail "unsupported row missing"
"$bin" sweep --models vanilla,exact-tiled --seq-lens 64,100 "${quick[@]}" --no-measure --out "$work/s2.json" \
  >"$work/s2.txt" 2>/dev/null && [ "$(grep -c '"status": "ok"' "$work/s2.json")" -eq 4 ] \
  && grep -q "exact-tiled" "$work/s2.txt" && pass || fail "sweep of 4 ok points"
cp "$work/s2.json" "$work/s3.json"
"$bin" sweep --models vanilla,exact-tiled --seq-lens 64,100,128 "${quick[@]}" --no-measure --resume \
  --out "$work/s3.json" >/dev/null 2>"$work/resume.err"
[ "$(grep -c '"status": "ok"' "$work/s3.json")" -eq 6 ] && [ "$(grep -c "^\[" "$work/resume.err")" -eq 2 ] \
  && pass || fail "resume did not run exactly the 2 missing points"
# A resumed report must be this sweep's: a row at a length it does not have, or a point twice, is
# refused (the report is left as it was).
for doctoring in 'r["results"][0]["seq_len"] = 65|is not a point of this sweep' \
  'r["results"].append(r["results"][0])|repeats a point'; do
  python3 -c 'import json, sys; r = json.load(open(sys.argv[1])); exec(sys.argv[2]); json.dump(r, open(sys.argv[3], "w"))' \
    "$work/s2.json" "${doctoring%%|*}" "$work/doctored.json"
  cp "$work/doctored.json" "$work/doctored-copy.json"
  expect_error 2 sweep --models vanilla,exact-tiled --seq-lens 64,100 "${quick[@]}" --no-measure --resume \
    --out "$work/doctored.json"
  grep -q "${doctoring##*|}" "$work/err" && cmp -s "$work/doctored.json" "$work/doctored-copy.json" && pass \
    || fail "--resume of a doctored report ($doctoring): $(cat "$work/err")"
done
# Shards of a grown sweep: the points are dealt anew, so a finished point may now be the other
# shard's. Each shard drops what is no longer its own, and the two merge without a duplicate.
for shard in 1/2 2/2; do
  "$bin" sweep --models vanilla --seq-lens 64,100 "${quick[@]}" --no-measure --no-table --shard "$shard" \
    --out "$work/shard-${shard%/*}.json" 2>/dev/null
done
for shard in 1/2 2/2; do
  "$bin" sweep --models vanilla,exact-tiled --seq-lens 64,100 "${quick[@]}" --no-measure --no-table --shard "$shard" \
    --resume --out "$work/shard-${shard%/*}.json" 2>/dev/null
done
"$bin" merge "$work/shard-1.json" "$work/shard-2.json" --out "$work/shards.json" 2>"$work/err" \
  && [ "$(grep -c '"status": "ok"' "$work/shards.json")" -eq 4 ] && pass \
  || fail "the resumed shards of a grown sweep do not merge: $(cat "$work/err")"
# One thread: with two on an oversubscribed machine, preempted OpenMP barriers stretch the 1000
# quick repetitions of N=64 past the timeout.
"$bin" sweep --models vanilla --seq-lens 64,4096 --heads 2 --head-dim 16 --threads 1 --no-measure --min-time 30 --timeout 8 \
  --out "$work/timeout.json" >/dev/null 2>&1
grep -q 'timed out after 8 s' "$work/timeout.json" && [ "$(grep -c '"status": "ok"' "$work/timeout.json")" -eq 1 ] \
  && pass || fail "a timed-out point did not become an error row while the sweep went on"
"$bin" sweep --models vanilla --seq-lens 64,400000 "${quick[@]}" --no-measure --out "$work/oom.json" >/dev/null 2>&1
grep -q 'out of memory' "$work/oom.json" && [ "$(grep -c '"status": "ok"' "$work/oom.json")" -eq 1 ] \
  && pass || fail "an out-of-memory point did not become an error row while the sweep went on"
# --resume keeps error rows; with --retry-errors it runs them again (here: out of memory again).
"$bin" sweep --models vanilla --seq-lens 64,400000 "${quick[@]}" --no-measure --resume --out "$work/oom.json" \
  >/dev/null 2>"$work/resume.err" && [ "$(grep -c "^\[" "$work/resume.err")" -eq 0 ] && pass \
  || fail "--resume ran a finished error row again: $(cat "$work/resume.err")"
"$bin" sweep --models vanilla --seq-lens 64,400000 "${quick[@]}" --no-measure --resume --retry-errors \
  --out "$work/oom.json" >/dev/null 2>"$work/resume.err" && grep -q "^\[2/2\] vanilla N=400000" "$work/resume.err" \
  && [ "$(grep -c "^\[" "$work/resume.err")" -eq 1 ] && [ "$(grep -c '"status": "error"' "$work/oom.json")" -eq 1 ] \
  && [ "$(grep -c '"status": "ok"' "$work/oom.json")" -eq 1 ] && pass \
  || fail "--resume --retry-errors: $(cat "$work/resume.err")"
expect_error 2 sweep --models vanilla --seq-lens 64 --no-measure --retry-errors --out "$work/never.json"
for metric in time speedup memory memory-ratio gflops; do
  for format in text md csv; do
    "$bin" table "$work/s2.json" --metric "$metric" --format "$format" >"$work/t.txt" && grep -q "vanilla" "$work/t.txt" \
      && pass || fail "table --metric $metric --format $format"
  done
done
"$bin" table "$work/s2.json" --metric speedup --format md | grep -q "1.00×" && pass || fail "vanilla speed-up over itself"

# --- list and env ------------------------------------------------------------------------------
# One registry row each (counted in the source, independently of the binary).
registry_rows=$(grep -c '^  row(model<' "$(dirname "$0")/../../taxonomy/registry_rows.hpp")
[ "$("$bin" list --format json | grep -c '"survey_row"')" -eq "$registry_rows" ] && pass || fail "list --format json"
"$bin" list --implemented | grep -q "^exact-tiled" && pass || fail "list --implemented"
"$bin" list --format json | python3 -c 'import json, sys; m = {r["name"]: r for r in json.load(sys.stdin)}
assert all(r["backward"] for r in m.values() if r["implemented"]), m
assert all(r["incremental"] == r["decodes"] and bool(r["decode_cost"]) == r["decodes"] for r in m.values()), m
bf16 = [n for n, r in m.items() if "bf16" in r["dtypes"]]
assert {"vanilla", "exact-tiled", "performer", "linear-transformer", "local", "image-transformer", "reformer", "rfa", "sinkhorn", "longformer", "bigbird", "etc", "tokenlearner", "poolingformer", "memory-compressed", "linformer", "funnel", "set-transformer", "nystromformer", "cluster-former", "transformer-xl", "compressive", "synthesizer", "adaptive-sparse", "luna", "perceiver", "long-short", "routing", "switch", "gshard"} <= set(bf16) and {n for n, r in m.items() if r["ffn"]} == {"switch", "gshard"} and all(r["dtypes"][0] == "f32" for r in m.values()), bf16' \
  && pass || fail "list --format json: backward, incremental form, decode cost and dtypes"
"$bin" list --class kernels --format md | grep -q "Performer" && pass || fail "list --class kernels"
"$bin" env --json | grep -q '"onednn_version"' && pass || fail "env"
# Standard output that cannot be written (a full disk) is a runtime error, not a silent success.
for command in "list" "list --format json" "table $src/results/ci-baseline.json" "env --json"; do
  # shellcheck disable=SC2086
  "$bin" $command >/dev/full 2>"$work/err"
  code=$?
  [ "$code" -eq 3 ] && [ "$(grep -vc "this build is not optimised" "$work/err")" -eq 1 ] && grep -q "standard output" "$work/err" \
    && pass || fail "xfbench $command >/dev/full exited $code: $(cat "$work/err")"
done

# --- compare on doctored reports ------------------------------------------------------------------
source "$src/tests/cli/doctor.sh"
timed=(--heads 2 --head-dim 16 --min-reps 7 --min-time 0 --threads 2 --no-measure --no-table)
"$bin" sweep --models vanilla,exact-tiled --seq-lens 64,128 "${timed[@]}" --out "$work/base.json" >/dev/null 2>&1 \
  && pass || fail "sweep for compare"
steady_times <"$work/base.json" >"$work/steady.json"
mv "$work/steady.json" "$work/base.json"
scale_times 2 <"$work/base.json" >"$work/slower.json"
bump_first peak_tensor_bytes 1 <"$work/base.json" >"$work/memory.json"
bump_first flops 64 <"$work/base.json" >"$work/flops.json"
sed '0,/"status": "ok"/s//"status": "error"/' "$work/base.json" >"$work/error.json"
sed 's/"cpu_model": "[^"]*"/"cpu_model": "Another CPU"/' "$work/base.json" >"$work/othercpu.json"

"$bin" compare "$work/base.json" "$work/base.json" >"$work/c.txt"
[ $? -eq 0 ] && ! grep -q "REGRESSION" "$work/c.txt" && grep -q "0 regression(s)" "$work/c.txt" \
  && pass || fail "compare of identical reports"
"$bin" compare "$work/base.json" "$work/slower.json" >"$work/c.txt"
[ $? -eq 1 ] && [ "$(grep -c "REGRESSION: time" "$work/c.txt")" -eq 4 ] && grep -q "time 2.000×" "$work/c.txt" \
  && pass || fail "compare: 2× slower must be 4 time regressions: $(cat "$work/c.txt")"
"$bin" compare "$work/base.json" "$work/slower.json" --metrics memory,flops >"$work/c.txt"
[ $? -eq 0 ] && grep -q "slower" "$work/c.txt" && pass || fail "compare: time reported but not gated"
"$bin" compare "$work/base.json" "$work/memory.json" >"$work/c.txt"
[ $? -eq 1 ] && grep -q "REGRESSION: memory" "$work/c.txt" && grep -q "+1 B" "$work/c.txt" \
  && pass || fail "compare: memory +1 byte"
"$bin" compare "$work/base.json" "$work/memory.json" --max-memory-growth 1% >/dev/null && pass || fail "--max-memory-growth 1%"
"$bin" compare "$work/base.json" "$work/flops.json" --format md >"$work/c.md"
[ $? -eq 1 ] && grep -q "REGRESSION: flops" "$work/c.md" && grep -q "^| point" "$work/c.md" \
  && pass || fail "compare: FLOP change gates, md format"
"$bin" compare "$work/base.json" "$work/flops.json" --metrics time,memory >/dev/null && pass || fail "flops gate off"
"$bin" compare "$work/base.json" "$work/error.json" --metrics memory --format json >"$work/c.json"
[ $? -eq 1 ] && grep -q '"verdict": "error"' "$work/c.json" && grep -q '"error_regressions": 1' "$work/c.json" \
  && pass || fail "compare: ok→error is a regression"
expect_error 2 compare "$work/base.json" "$work/othercpu.json"
grep -q "cpu_model ('.*' vs 'Another CPU')" "$work/err" && grep -q -- "--allow-different-context" "$work/err" \
  && pass || fail "context mismatch must name the field: $(cat "$work/err")"
"$bin" compare "$work/base.json" "$work/othercpu.json" --allow-different-context >/dev/null && pass || fail "--allow-different-context"
# Memory and FLOPs do not depend on the CPU model; another oneDNN ISA leaves the scratchpad out
# of the memory gate (one byte more total, same owned bytes: no regression) but not the owned bytes.
"$bin" compare "$work/base.json" "$work/othercpu.json" --metrics memory,flops >/dev/null \
  && pass || fail "compare --metrics memory,flops across CPU models"
expect_error 2 compare "$work/base.json" "$work/othercpu.json" --metrics time
sed 's/"onednn_isa": "[^"]*"/"onednn_isa": "another_isa"/' "$work/memory.json" >"$work/otherisa.json"
"$bin" compare "$work/base.json" "$work/otherisa.json" --metrics memory,flops >"$work/c.txt" \
  && grep -q "scratchpad not compared" "$work/c.txt" && pass || fail "scratchpad compared across ISAs: $(cat "$work/c.txt")"
bump_first peak_owned_bytes 1 <"$work/otherisa.json" >"$work/otherisa-owned.json"
"$bin" compare "$work/base.json" "$work/otherisa-owned.json" --metrics memory >"$work/c.txt"
[ $? -eq 1 ] && grep -q "REGRESSION: memory" "$work/c.txt" && pass || fail "owned bytes not gated across ISAs"
echo '{"schema_version": 1, "results": []}' >"$work/empty.json"
expect_error 2 compare "$work/base.json" "$work/broken.json"
expect_error 2 compare "$work/future.json" "$work/base.json"
expect_error 2 compare "$work/base.json" "$work/empty.json"
expect_error 2 compare "$work/base.json" "$work/nosuch.json"
expect_error 2 compare "$work/base.json" "$work/base.json" --metrics time,speed
expect_error 2 compare "$work/base.json" "$work/base.json" --max-slowdown fast
expect_error 2 compare "$work/base.json"
# A point's key, as docs/report-schema.md#matching-points lists it: every field of an ok row changed
# alone in NEW, compare matches the two rows exactly when the field is not in the list; on a forward
# and a decode row. Arrays and objects of measurements are not tried.
"$bin" sweep --models vanilla --seq-lens 64 --pass decode --decode-tokens 2 "${timed[@]}" \
  --out "$work/decode-key.json" >/dev/null 2>&1 || fail "decode sweep for the key check"
python3 - "$bin" "$src/docs/report-schema.md" "$work" "$work/base.json" "$work/decode-key.json" \
  >"$work/key.txt" 2>&1 <<'PY'
import copy, json, re, subprocess, sys
binary, schema, work, reports = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
section = open(schema).read().split("## Matching points", 1)[1].split("\n## ", 1)[0]
sentence = section.split("identify a point by its key:", 1)[1].split(".\n", 1)[0]
documented = set(re.findall(r"`(\w+)`", sentence))
valid_other = {"model": "exact-tiled", "scope": "layer", "pass": "train", "dtype": "bf16", "ffn": "switch",
               "status": "error", "kernel_isa": "avx512", "params": {"nosuch": 1}}
problems, tried = [], set()
for report in reports:
    base = json.load(open(report))
    base["results"] = [r for r in base["results"] if r["status"] == "ok"][:1]
    row = base["results"][0]
    json.dump(base, open(f"{work}/key-base.json", "w"))
    for field, value in row.items():
        if field in valid_other:
            changed = valid_other[field]
        elif field in ("median_ns", "out_len"):  # kept within the row's own bounds (min ≤ median; ≤ N)
            changed = row["min_ns"] if field == "median_ns" else value - 1
        elif isinstance(value, bool):
            changed = not value
        elif isinstance(value, int):
            changed = value + 1
        elif isinstance(value, float):  # within min_ns ≤ median_ns ≤ max_ns and host_busy ≤ 1
            changed = value * 0.5 if field in ("min_ns", "host_busy") else value + 1
        elif isinstance(value, str):
            changed = value + "x"
        else:
            continue
        new = copy.deepcopy(base)
        new["results"][0][field] = changed
        json.dump(new, open(f"{work}/key-new.json", "w"))
        run = subprocess.run([binary, "compare", f"{work}/key-base.json", f"{work}/key-new.json", "--format", "json",
                              "--metrics", "memory"], capture_output=True, text=True)
        if run.returncode == 2:
            problems.append(f"{field}: the changed row was refused: {run.stderr.strip()}")
            continue
        tried.add(field)
        verdicts = sorted(p["verdict"] for p in json.loads(run.stdout)["points"])
        if (verdicts != ["missing", "new"]) == (field in documented):
            problems.append(f"{row['pass']} row, {field} changed alone: verdicts {verdicts}, in the documented key: "
                            f"{field in documented}")
if documented - tried:
    problems.append("documented but in no row: " + ", ".join(sorted(documented - tried)))
print("\n".join(problems) if problems else f"{len(tried)} fields tried; the key is the documented one")
sys.exit(1 if problems else 0)
PY
[ $? -eq 0 ] && pass || fail "docs/report-schema.md's key and compare's disagree: $(cat "$work/key.txt")"

# --- ab: interleaved A/B, contention fields, dashboard exports ----------------------------------
tiny=(--seq-lens 64 --heads 2 --head-dim 16 --threads 2 --min-reps 3 --min-time 0 --rounds 4)
# No verdict can pass a 1000% threshold: exit 0 whatever this machine's noise.
"$bin" ab --models local "${tiny[@]}" --a-param block=16 --b-param block=32 --max-slowdown 1000% --format json \
  --out "$work/ab.json" >"$work/ab.out" 2>/dev/null && grep -q '"verdict"' "$work/ab.out" \
  && grep -q '"order": "BA"' "$work/ab.json" && pass || fail "ab of two parameter sets"
# A side whose binary fails is an error verdict: exit 1, the reason kept.
printf '#!/bin/sh\nexit 4\n' >"$work/broken-bin"
chmod +x "$work/broken-bin"
"$bin" ab --models local "${tiny[@]}" --b-bin "$work/broken-bin" >"$work/ab.out" 2>/dev/null
[ $? -eq 1 ] && grep -q "error" "$work/ab.out" && grep -q "exited with code 4" "$work/ab.out" \
  && pass || fail "ab with a failing B binary must exit 1: $(cat "$work/ab.out")"
# Four rounds at --alpha 0.01 are too few for an interval: the point is noisy, so the dashboard
# export leaves it out and says so. At --alpha 0.5 a verdict is possible: a point is exported
# exactly when it has one.
"$bin" ab --models local "${tiny[@]}" --max-slowdown 1000% --format bmf >"$work/ab.bmf" 2>"$work/ab.err" \
  && [ "$(tr -d ' \n' <"$work/ab.bmf")" = "{}" ] \
  && grep -q "left out 1 A/B point(s): 1 noisy, 0 error" "$work/ab.err" && pass || fail "ab --format bmf: a noisy point"
"$bin" ab --models local "${tiny[@]}" --alpha 0.5 --max-slowdown 1000% --format bmf --out "$work/ab-bmf.json" \
  >"$work/ab.bmf" 2>"$work/ab.err" && python3 -c 'import json, sys
verdict = json.load(open(sys.argv[1]))["points"][0]["verdict"]
bmf, note = json.load(open(sys.argv[2])), open(sys.argv[3]).read()
if verdict == "noisy":
    assert bmf == {} and "1 noisy" in note, (bmf, note)
else:
    [entry] = bmf.values()
    assert "latency" in entry and "ratio" in entry and "left out" not in note, (bmf, note)' \
  "$work/ab-bmf.json" "$work/ab.bmf" "$work/ab.err" && pass || fail "ab --format bmf: $(cat "$work/ab.bmf")"
expect_error 2 ab --models local --rounds 1
expect_error 2 ab --models nosuch
expect_error 2 ab --models local --b-bin "$work/nosuch-bin"
expect_error 2 ab --models local,axial --b-model vanilla
expect_error 2 ab --models local --out "$work/nosuch/ab.json"
[ ! -e "$work/nosuch" ] && pass || fail "ab wrote into a missing folder"
grep -q '"contended_samples":' "$work/base.json" && grep -q '"cpu_ratio":' "$work/base.json" \
  && grep -q '"host_busy":' "$work/base.json" && pass || fail "rows carry the contention fields"
"$bin" table "$work/base.json" --format github-benchmark >"$work/gab.json" && grep -q '"unit": "ms"' "$work/gab.json" \
  && grep -q '"range": "± ' "$work/gab.json" && pass || fail "table --format github-benchmark"
"$bin" table "$work/base.json" --format bmf >"$work/bmf.json" && grep -q '"lower_value"' "$work/bmf.json" \
  && pass || fail "table --format bmf"

# --- shards and merge ------------------------------------------------------------------------
few=(--heads 2 --head-dim 16 --min-reps 1 --min-time 0 --threads 2 --no-measure --no-table)
models=vanilla,exact-tiled,linformer
"$bin" sweep --models $models --seq-lens 64,100,128 "${few[@]}" --out "$work/whole.json" >/dev/null 2>&1
for i in 1 2 3; do
  "$bin" sweep --models $models --seq-lens 64,100,128 "${few[@]}" --shard "$i/3" --out "$work/shard$i.json" \
    >/dev/null 2>&1 || fail "shard $i/3"
done
[ $(($(grep -c '"model":' "$work/shard1.json") + $(grep -c '"model":' "$work/shard2.json") + \
     $(grep -c '"model":' "$work/shard3.json"))) -eq 9 ] && grep -q '"shard": "2/3"' "$work/shard2.json" \
  && pass || fail "three shards hold the nine points"
"$bin" merge "$work/shard3.json" "$work/shard1.json" "$work/shard2.json" -o "$work/merged.json" 2>"$work/err" \
  && grep -q "info: merged 3 report(s), 9 point(s)" "$work/err" && pass || fail "merge of shards: $(cat "$work/err")"
# -q: warnings and errors only (the sweep's "report written" and merge's summary are info).
"$bin" -q merge "$work/shard3.json" "$work/shard1.json" "$work/shard2.json" -o "$work/merged-q.json" 2>"$work/err" \
  && [ ! -s "$work/err" ] && pass || fail "merge -q printed: $(cat "$work/err")"
"$bin" sweep -q --models vanilla --seq-lens 16 "${few[@]}" --out "$work/quiet.json" 2>"$work/err"
! grep -q "report written\|\[1/1\]" "$work/err" && [ -s "$work/quiet.json" ] \
  && pass || fail "sweep -q printed progress or its info line: $(cat "$work/err")"
# Same point set (compare: no new or missing point; deterministic metrics equal) and same order.
"$bin" compare "$work/whole.json" "$work/merged.json" --metrics memory,flops --format json >"$work/m.json" \
  && ! grep -q '"new"\|"missing"' "$work/m.json" && grep -q '"points": 9' "$work/m.json" \
  && pass || fail "merged shards differ from the unsharded sweep"
diff <(grep -E '"(model|seq_len)":' "$work/whole.json") <(grep -E '"(model|seq_len)":' "$work/merged.json") >/dev/null \
  && pass || fail "merged points are not in sweep order"
[ "$(grep -c '"shard": "[123]/3"' "$work/merged.json")" -eq 3 ] && grep -q '"merged_from"' "$work/merged.json" \
  && pass || fail "merged provenance"
expect_error 2 merge "$work/shard1.json" "$work/shard1.json" -o "$work/dup.json"
grep -q "duplicate point" "$work/err" && [ ! -e "$work/dup.json" ] && pass || fail "duplicate points must be rejected"
sed 's/"cpu_model": "[^"]*"/"cpu_model": "Another CPU"/' "$work/shard2.json" >"$work/shard2-other.json"
expect_error 2 merge "$work/shard1.json" "$work/shard2-other.json" -o "$work/mixed.json"
[ ! -e "$work/mixed.json" ] && pass || fail "mismatched contexts must write nothing"
"$bin" sweep --models $models --seq-lens 64,100 "${few[@]}" --shard 1/2 --out "$work/other-settings.json" >/dev/null 2>&1
expect_error 2 merge "$work/shard1.json" "$work/other-settings.json" -o "$work/mixed.json"
expect_error 2 merge "$work/shard1.json" "$work/broken.json" -o "$work/mixed.json"
expect_error 2 sweep --models vanilla --seq-lens 64 --shard 3/2 --out "$work/r.json"
expect_error 2 sweep --models vanilla --seq-lens 64 --shard 1-2 --out "$work/r.json"

# --- plot, complexity, taxonomy, table extras --------------------------------------------------
for metric in time memory speedup; do
  "$bin" plot "$work/base.json" --metric "$metric" --out "$work/$metric.svg" && head -1 "$work/$metric.svg" | grep -q '^<?xml' \
    && [ "$(grep -c 'class="point"' "$work/$metric.svg")" -eq 4 ] && pass || fail "plot --metric $metric"
done
if command -v xmllint >/dev/null; then
  xmllint --noout "$work/time.svg" && pass || fail "plot output is not well-formed XML"
fi
expect_error 2 plot "$work/base.json" --out "$work/missing/p.svg"
expect_error 2 plot "$work/empty.json" --out "$work/p.svg"
expect_error 2 plot "$work/base.json" --metric nosuch --out "$work/p.svg"
[ ! -e "$work/p.svg" ] && pass || fail "a failed plot wrote a file"
"$bin" sweep --models vanilla,exact-tiled --seq-lens 32,64,128 "${few[@]}" --out "$work/fit.json" >/dev/null 2>&1
"$bin" complexity "$work/fit.json" >"$work/fit.txt" && [ "$(grep -c " match" "$work/fit.txt")" -eq 2 ] \
  && pass || fail "complexity: vanilla and exact-tiled execute O(N²) FLOPs: $(cat "$work/fit.txt")"
"$bin" complexity "$work/fit.json" --format json | grep -q '"best": "N²"' && pass || fail "complexity --format json"
"$bin" table "$work/fit.json" --complexity | grep -q "N² ✓" && pass || fail "table --complexity"
# docs/cli.md#complexity's two mapping tables name every complexity and decode cost the registry prints.
"$bin" list --format json | python3 -c 'import json, re, sys
section = open(sys.argv[1]).read().split("\n## complexity\n", 1)[1].split("\n## ", 1)[0]
tables = re.findall(r"\| (?:survey.s string|decode cost) \|.*?\n\n", section, re.S)
def cells(table):
    rows = [line.split("|")[1] for line in table.splitlines()[2:] if line.startswith("|")]
    return {re.sub(r"\s", "", c).lower() for row in rows for c in row.split(", ")}
survey, decode = (cells(t) for t in tables)
norm = lambda text: re.sub(r"\s", "", text).lower()
models = json.load(sys.stdin)
gaps = [m["name"] + ": " + m["complexity"] for m in models if norm(m["complexity"]) not in survey]
gaps += [m["name"] + " (revision): " + m["revised_complexity"] for m in models if m["revised_complexity"] and norm(m["revised_complexity"]) not in survey]
gaps += [m["name"] + " decodes at " + m["decode_cost"] for m in models if m["decode_cost"] and norm(m["decode_cost"]) not in decode]
assert len(tables) == 2 and not gaps, gaps' "$src/docs/cli.md" && pass || fail "docs/cli.md#complexity misses a mapping"
expect_error 2 complexity "$work/empty.json"
expect_error 2 complexity "$work/future.json"
"$bin" taxonomy --format md | grep -q "| 14 | v1 | Performer" && pass || fail "taxonomy md"
[ "$("$bin" taxonomy --format json | grep -c '"survey_row"')" -eq "$registry_rows" ] && pass || fail "taxonomy json"
"$bin" taxonomy --format svg --out "$work/taxonomy.svg" &&
  [ "$(grep -c 'class="model"' "$work/taxonomy.svg")" -eq "$registry_rows" ] \
  && pass || fail "taxonomy svg"
if command -v xmllint >/dev/null; then
  xmllint --noout "$work/taxonomy.svg" && pass || fail "taxonomy svg is not well-formed XML"
fi
expect_error 2 taxonomy --format pdf

# --- LRA preset and table --paper lra ------------------------------------------------------------
# The preset with its shape shrunk: preset models that are not implemented become unsupported rows.
"$bin" sweep --preset lra --seq-lens 1024 --batch 1 --heads 1 --head-dim 16 --d-ff 32 --min-reps 1 --min-time 0 --no-measure \
  --out "$work/lra.json" >/dev/null 2>&1 && pass || fail "sweep --preset lra"
[ "$(grep -c '"model":' "$work/lra.json")" -eq 9 ] && grep -q '"preset": "lra"' "$work/lra.json" \
  && grep -q '"scope": "layer"' "$work/lra.json" && grep -q '"d_ff": 32' "$work/lra.json" \
  && pass || fail "the LRA preset's points"
"$bin" table "$work/lra.json" --paper lra >"$work/lra.txt" && grep -q "Spearman" "$work/lra.txt" \
  && grep -q "performer (Performer)" "$work/lra.txt" && pass || fail "table --paper lra"
"$bin" table "$work/lra.json" --paper lra --format md | grep -q "^| vanilla (Transformer)" && pass || fail "table --paper lra md"
# Both passes in one sweep of the preset: ρ side by side per pass.
"$bin" sweep --preset lra --pass forward,train --seq-lens 1024 --batch 1 --heads 1 --head-dim 16 --d-ff 32 \
  --min-reps 1 --min-time 0 --no-measure --out "$work/lra-both.json" >/dev/null 2>&1 \
  && [ "$(grep -c '"pass": "train"' "$work/lra-both.json")" -eq 9 ] \
  && grep -q '"pass": "forward,train"' "$work/lra-both.json" && pass || fail "sweep --preset lra --pass forward,train"
"$bin" table "$work/lra-both.json" --paper lra >"$work/lra-both.txt" \
  && grep -q "ρ speed forward.*ρ speed train.*ρ memory forward.*ρ memory train" "$work/lra-both.txt" \
  && grep -q "layer, train pass" "$work/lra-both.txt" && pass || fail "table --paper lra: ρ by pass side by side"
expect_error 2 run --model vanilla --seq-len 64 --pass forward,train
expect_error 2 sweep --models vanilla --seq-lens 64 --pass train,train --out "$work/r.json"
expect_error 2 table "$work/base.json" --paper lra
expect_error 2 table "$work/lra.json" --paper nosuch
expect_error 2 sweep --preset nosuch --out "$work/r.json"

# --- the report schema document names exactly the fields reports carry ----------------------------
# One measured sweep (the context's peak fields) with a preset and a shard (the optional settings),
# then merged (context.merged_from), and a threads grid (context.machine_by_threads): together they
# carry every field the writer emits. Objects whose
# keys are data (a row's params, stage_median_ns) are single fields; arrays of objects are `name[]`.
schema_doc="$src/docs/report-schema.md"
"$bin" sweep --preset lra --models vanilla --seq-lens 32,64 --batch 1 --heads 1 --head-dim 16 --d-ff 32 --threads 2 \
  --min-reps 1 --min-time 0 --shard 1/2 --no-table --out "$work/schema-shard.json" >/dev/null 2>&1 \
  && "$bin" merge "$work/schema-shard.json" -o "$work/schema-merged.json" 2>/dev/null \
  && "$bin" sweep --models local --seq-lens 32 --heads 1 --head-dim 16 --threads 1,2 --min-reps 1 --min-time 0 \
    --no-table --out "$work/schema-grid.json" >/dev/null 2>&1 \
  && pass || fail "sweep, merge and a threads grid (context.machine_by_threads) for the schema check"
if ! command -v python3 >/dev/null; then
  fail "python3 is needed to check docs/report-schema.md against reports (tools/install_deps.sh installs it)"
else
  python3 - "$schema_doc" "$work/schema-shard.json" "$work/schema-merged.json" "$work/schema-grid.json" \
    >"$work/schema.txt" 2>&1 <<'PY'
import json, re, sys

doc, reports = sys.argv[1], sys.argv[2:]
data_keyed = {"results[].params", "results[].stage_median_ns", "context.machine_by_threads"}

def walk(value, path, out):
    if isinstance(value, dict):
        for key, child in value.items():
            field = f"{path}.{key}" if path else key
            out.add(field)
            if field not in data_keyed:
                walk(child, field, out)
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, dict):
                walk(item, path + "[]", out)

emitted = set()
for report in reports:
    with open(report, encoding="utf-8") as f:
        walk(json.load(f), "", emitted)

# Field tables: in a section headed "Fields of the report" or "Fields of `object`", every table
# row's first cell is one field name in backticks.
documented, twice, unparsed, prefix = set(), [], [], None
with open(doc, encoding="utf-8") as f:
    for line in f:
        heading = re.match(r"#+\s+(.*?)\s*$", line)
        if heading:
            section = re.fullmatch(r"Fields of (?:the report|`([^`]+)`)", heading.group(1))
            prefix = None if section is None else (section.group(1) + "." if section.group(1) else "")
            continue
        if prefix is None or not line.startswith("|") or re.match(r"\|\s*(field\s*\||-)", line):
            continue
        row = re.match(r"\|\s*`([A-Za-z0-9_]+)`\s*\|", line)
        if row is None:
            unparsed.append(line.strip()[:60])
            continue
        field = prefix + row.group(1)
        (twice if field in documented else []).append(field)
        documented.add(field)

problems = []
if emitted - documented:
    problems.append("emitted but not in docs/report-schema.md: " + ", ".join(sorted(emitted - documented)))
if documented - emitted:
    problems.append("in docs/report-schema.md but not emitted: " + ", ".join(sorted(documented - emitted)))
if twice:
    problems.append("listed twice: " + ", ".join(twice))
if unparsed:
    problems.append("field-table rows without one `field` first: " + "; ".join(unparsed))
print("\n".join(problems) if problems else f"{len(documented)} fields, documented and emitted alike")
sys.exit(1 if problems else 0)
PY
  [ $? -eq 0 ] && pass || fail "docs/report-schema.md and the report writer disagree: $(cat "$work/schema.txt")"
fi

# --- the README's model table is the registry's: `xfbench list --format md` ------------------------
sed -n '/^<!-- generated by `xfbench list --format md`/,/^<!-- end of the generated table -->/p' "$src/README.md" \
  | sed '1d;$d' >"$work/readme-models.md"
"$bin" list --format md >"$work/list-models.md"
[ -s "$work/readme-models.md" ] && diff -q "$work/readme-models.md" "$work/list-models.md" >/dev/null && pass \
  || fail "README's model table differs from xfbench list --format md (tools/readme_models.sh rewrites it)"

# --- layers: the build's include check passes on the tree and fails on a wrong-way include ---
bash "$src/cmake/check_layers.sh" "$src" && pass || fail "cmake/check_layers.sh rejects the tree"
mkdir -p "$work/layers/lib/core" "$work/layers/apps/report" "$work/layers/taxonomy"
printf '#include "apps/bench/point.hpp"\n' >"$work/layers/lib/core/wrong.hpp"
printf '#include "taxonomy/registry.hpp"\n' >"$work/layers/apps/report/kernels.cpp"
bash "$src/cmake/check_layers.sh" "$work/layers" 2>"$work/layers.err"
[ $? -eq 1 ] && [ "$(wc -l <"$work/layers.err")" -eq 2 ] && pass \
  || fail "cmake/check_layers.sh misses a wrong-way include: $(cat "$work/layers.err")"

echo "$passes passed, $failures failed"
[ "$failures" -eq 0 ]
