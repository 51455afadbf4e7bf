#!/usr/bin/env bash
# End-to-end tests of the xfbench command line: exit codes, one-line errors, no partial output,
# run/sweep/table/list/env behaviour, child-process isolation, resume and memory-limit skips.
set -u
bin="$1"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0
passes=0

pass() { passes=$((passes + 1)); }
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

# expect_error CODE ARGS...: exits with CODE, prints exactly one stderr line, nothing on stdout.
expect_error() {
  local code=$1
  shift
  "$bin" "$@" >"$work/out" 2>"$work/err"
  local got=$?
  local lines
  lines=$(wc -l <"$work/err")
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
expect_error 2 sweep --models vanilla --seq-lens 64 --out "$work/missing/r.json"
[ ! -e "$work/missing" ] && pass || fail "a folder was created for a bad --out"
expect_error 2 sweep --models nosuch --seq-lens 64 --out "$work/r.json"
expect_error 2 sweep --models vanilla --seq-lens 0 --out "$work/r.json"
expect_error 2 sweep --models vanilla --seq-lens 64:32:x2 --out "$work/r.json"
expect_error 2 sweep --models vanilla --seq-lens 64 --param block_q=8 --out "$work/r.json"
[ ! -e "$work/r.json" ] && pass || fail "a report file was written for bad input"
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
  && grep -q '"status":"ok"' "$work/run.json" && grep -q '"reproducer":"xfbench run --model exact-tiled' "$work/run.json" \
  && pass || fail "run --json: $(cat "$work/err")"
"$bin" run --model exact-tiled --seq-len 100 "${quick[@]}" >"$work/run.txt" && grep -q "^median" "$work/run.txt" \
  && pass || fail "run prints a human summary"
# The reproducer line reruns the same point.
reproducer=$(sed -n 's/.*"reproducer":"xfbench \([^"]*\)".*/\1/p' "$work/run.json")
# shellcheck disable=SC2086
"$bin" $reproducer --json >"$work/rerun.json" && grep -q '"flops":' "$work/rerun.json" \
  && [ "$(grep -o '"flops":[0-9]*' "$work/run.json")" = "$(grep -o '"flops":[0-9]*' "$work/rerun.json")" ] \
  && pass || fail "the reproducer does not rerun the point"
# The first model not implemented in this build, if any is left.
unimplemented=$("$bin" list --format json | tr -d ' \n' | grep -o '"implemented":false,"name":"[^"]*"' | head -1 \
  | sed 's/.*"name":"//; s/"$//')
if [ -n "$unimplemented" ]; then
  "$bin" run --model "$unimplemented" --seq-len 64 "${quick[@]}" --json >"$work/unsupported.json"
  grep -q '"status":"unsupported"' "$work/unsupported.json" && pass || fail "unimplemented model is not an unsupported row"
fi
"$bin" run --model bigbird --seq-len 64 --causal "${quick[@]}" --json >"$work/causal.json"
grep -q '"status":"unsupported"' "$work/causal.json" && pass || fail "causal non-decoder is not unsupported"
"$bin" run --model vanilla --seq-len 33 "${quick[@]}" --scope layer --dump "$work/dump" >/dev/null \
  && [ -f "$work/dump/manifest.json" ] && [ -f "$work/dump/q.npy" ] && [ -f "$work/dump/out.npy" ] \
  && [ -f "$work/dump/layer_w_qkv.npy" ] && pass || fail "--dump files missing"

# --- sweep: report, table, progress, resume, memory limit, child isolation ----------------------
# Causal: linformer cannot decode, so its rows are unsupported whatever is implemented.
"$bin" sweep --models vanilla,exact-tiled,linformer --seq-lens 64,100 "${quick[@]}" --causal --no-measure \
  --memory-limit 0.0001 --out "$work/sweep.json" >"$work/sweep.txt" 2>"$work/sweep.err"
[ $? -eq 0 ] && pass || fail "sweep failed: $(tail -3 "$work/sweep.err")"
grep -q "\[6/6\]" "$work/sweep.err" && pass || fail "sweep progress lines missing"
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
"$bin" sweep --models vanilla --seq-lens 64,4096 --heads 2 --head-dim 16 --threads 2 --no-measure --min-time 30 --timeout 2 \
  --out "$work/timeout.json" >/dev/null 2>&1
grep -q 'timed out after 2 s' "$work/timeout.json" && [ "$(grep -c '"status": "ok"' "$work/timeout.json")" -eq 1 ] \
  && pass || fail "a timed-out point did not become an error row while the sweep went on"
for metric in time speedup memory gflops; do
  for format in text md csv; do
    "$bin" table "$work/s2.json" --metric "$metric" --format "$format" >"$work/t.txt" && grep -q "vanilla" "$work/t.txt" \
      && pass || fail "table --metric $metric --format $format"
  done
done
"$bin" table "$work/s2.json" --metric speedup --format md | grep -q "1.00×" && pass || fail "vanilla speed-up over itself"

# --- list and env ------------------------------------------------------------------------------
[ "$("$bin" list --format json | grep -c '"survey_row"')" -eq 20 ] && pass || fail "list --format json"
"$bin" list --implemented | grep -q "^exact-tiled" && pass || fail "list --implemented"
"$bin" list --class kernels --format md | grep -q "Performer" && pass || fail "list --class kernels"
"$bin" env --json | grep -q '"onednn_version"' && pass || fail "env"

echo "$passes passed, $failures failed"
[ "$failures" -eq 0 ]
