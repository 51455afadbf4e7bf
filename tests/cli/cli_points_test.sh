#!/usr/bin/env bash
# Careless and hostile points against every command that takes one (run, sweep, ab, env): each
# option at and past its range, non-numbers, repeats, size products past the limits, the child's
# --point JSON, memory past the limit, outputs that must not be clobbered, --resume of another
# sweep's report, and the exit status of sweeps whose points fail. Every refused input: exit 2, one
# stderr line naming the option, nothing on stdout, no file created, inputs unchanged.
#   tests/cli/cli_points_test.sh XFBENCH
set -u
bin="$1"
src="$(cd "$(dirname "$0")/../.." && pwd)"
source "$src/tests/cli/common.sh"

quick=(--heads 2 --head-dim 16 --min-reps 2 --threads 1)
# Every command that takes a point, as a valid command line the cases add hostile options to (none
# of the options the cases set, which would otherwise be refused as given twice).
point_commands=(
  "run -m local -n 64"
  "sweep --models local --seq-lens 64 --no-measure --no-table --out $out/s.json"
  "ab --models local --seq-lens 64 --out $out/ab.json"
)

# --- point options: NEEDLE | OPTIONS (each case through every point command) ---------------------
cases=(
  '--batch|--batch 0' '--batch|--batch -1' '--batch|--batch 99999999999999999999' '--batch|--batch 1.5'
  '--batch|--batch x' '--batch|--batch 2 --batch 3' '--heads|--heads 0' '--heads|--heads 1048577'
  '--head-dim|--head-dim 4611686018427387904' '--seed|--seed -1' '--seed|--seed 18446744073709551616'
  '--seed|--seed 1e3' '--min-time|--min-time nan' '--min-time|--min-time inf' '--min-time|--min-time -1'
  '--min-time|--min-time 1e309' '--max-reps|--max-reps 0' '--min-reps|--min-reps 10 --max-reps 5'
  '--warmup|--warmup 0' '--threads|--threads -3' '--threads|--threads 0' '--threads|--threads 99999'
  '--pass|--pass bogus' '--pass|--pass forward,forward' '--scope|--scope bogus' '--d-ff|--d-ff -1'
  '--decode-tokens|--pass decode --decode-tokens 0' 'attention scope|--pass decode --scope layer'
  'block|-p block=-1' 'block|-p block=x' '--min-reps|--min-reps 1,2' '--heads|--heads 2,0' '--heads|--heads 2,2'
  'exceeds the limit|--heads 65536 --head-dim 65536'
  'exceeds the limit|--batch 1048576 --heads 1048576'
  'exceeds the limit|--scope layer --heads 1024 --head-dim 1024 --d-ff 2147483647'
  '--ffn|--ffn bogus' '--ffn|--ffn switch' '--experts|--scope layer --ffn switch --experts 0'
  '--experts|--scope layer --ffn gshard --experts 1' '--capacity-factor|--scope layer --ffn switch --capacity-factor 0'
  '--capacity-factor|--scope layer --ffn gshard --capacity-factor -0.5' '--group-size|--scope layer --ffn switch --group-size -1'
)
for entry in "${cases[@]}"; do
  needle=${entry%%|*}
  options=${entry#*|}
  for command in "${point_commands[@]}"; do
    # shellcheck disable=SC2086
    expect_refusal 2 "$needle" $command $options
  done
done

# A parameter given twice: run and ab refuse it; sweep makes it a grid (tests/cli/cli_grid_test.sh).
expect_refusal 2 "given more than once" run -m local -n 64 -p block=8 -p block=16
expect_refusal 2 "given more than once" ab --models local --seq-lens 64 --out "$out/ab.json" -p block=8 -p block=16
expect_refusal 2 "one value per field" ab --models local --seq-lens 64 --out "$out/ab.json" --heads 2,4
expect_refusal 2 "given the value 8 twice" sweep --models local --seq-lens 64 --out "$out/s.json" -p block=8,8

# Sizes are judged at the lengths a sweep runs, not at run's default --seq-len: 8192 heads of 16384
# at N = 1 is one 2²⁷-element tensor per input, within the limits.
"$bin" sweep --models vanilla --seq-lens 1 --heads 8192 --head-dim 16384 --no-measure --dry-run >"$work/stdout" 2>&1 \
  && grep -q "1 would run" "$work/stdout" && pass || fail "sweep at N = 1 judged at another length: $(cat "$work/stdout")"
# How many lengths and points a sweep may plan (docs/cli.md#limits): refused before any is listed.
expect_refusal 2 "more than 10000 lengths" sweep --models local --seq-lens 1:2147483647:+1 --out "$out/s.json"
expect_refusal 2 "more than 10000 lengths" ab --models local --seq-lens 1:2147483647:+1 --out "$out/ab.json"
expect_refusal 2 "more than 10000 lengths" sweep --models local --seq-lens "$(seq -s, 1 10001)" --out "$out/s.json"
expect_refusal 2 "more than 100000" sweep --models all --seq-lens 1:9000:+1 --out "$out/s.json"
# Planning costs O(blocks) per point, not O(blocks²) (Big Bird's random-block candidates were listed
# per block): a point at 4M tokens is judged against the memory limit at once.
expect_refusal 2 "--memory-limit" run -m bigbird -n 4M --heads 1 --head-dim 1 --memory-limit 0.001
timeout 20 "$bin" sweep --models bigbird --seq-lens 256K -p block=1 --no-measure --dry-run >/dev/null 2>&1 \
  && pass || fail "sweep --dry-run of bigbird at 256K tokens in blocks of 1 took over 20 s or failed"
# No output may replace the binary that runs the points (sweep, ab) or a side's binary (ab).
cp "$bin" "$work/xfbench-copy"
before=$(sha256sum <"$work/xfbench-copy")
for command in "sweep --models local --seq-lens 64 --no-measure --out" \
  "ab --models local --seq-lens 64 --rounds 2 --out" \
  "ab --models local --seq-lens 64 --rounds 2 --a-bin $(realpath "$bin") --b-bin $work/xfbench-copy --out"; do
  # shellcheck disable=SC2086
  (cd "$work" && "./xfbench-copy" $command ./xfbench-copy >/dev/null 2>"$work/stderr")
  code=$?
  [ "$code" -eq 2 ] && grep -q "is the input" "$work/stderr" && [ "$(sha256sum <"$work/xfbench-copy")" = "$before" ] \
    && pass || fail "$command onto its binary: exit $code: $(cat "$work/stderr")"
  cp "$bin" "$work/xfbench-copy"
done
# An empty value that would read as "not given" is refused.
expect_refusal 2 "--dump" run -m local -n 64 --dump ""
expect_refusal 2 "--preset" sweep --models local --seq-lens 64 --preset "" --out "$out/s.json"

# --- run alone ---------------------------------------------------------------------------------
expect_refusal 2 --seq-len run -m local -n 9223372036854775807
expect_refusal 2 --seq-len run -m local -n 0
expect_refusal 2 "exceeds the limit" run -m vanilla -n 2147483647
expect_refusal 2 "--memory-limit" run -m vanilla -n 3000000 --heads 2
expect_refusal 2 "--memory-limit" run -m local -n 64 --memory-limit nan
expect_refusal 2 "--memory-limit" run -m local -n 64 --memory-limit -1
expect_refusal 2 "--memory-limit" run -m vanilla -n 50000 --memory-limit 0.001
expect_refusal 2 "--model" run -n 64
expect_refusal 2 "--point" run --point '{"model":'
expect_refusal 2 'the key "model" appears twice' run --point '{"model": "vanilla", "model": "local", "seq_len": 64}'
expect_refusal 2 "nesting" run --point "{\"model\": $(printf '[%.0s' {1..100})$(printf ']%.0s' {1..100})}"
expect_refusal 2 "seq_len" run --point '{"model": "local"}'
expect_refusal 2 "--point" run --point '{}' --batch 2
point_json=$(python3 - <<'PY'
import json
fields = {"model": "local", "seq_len": 64, "batch": 1, "heads": 2, "head_dim": 16, "scope": "attention",
          "pass": "forward", "decode_tokens": 64, "causal": False, "d_ff": 0, "ffn": "dense", "experts": 8,
          "capacity_factor": 1.25, "group_size": 0, "dtype": "f32", "threads": 1, "seed": 42,
          "params": [], "warmup": 1, "min_reps": 2, "min_time_s": 0.0, "max_reps": 1000}
print(json.dumps(fields))
bad = dict(fields, seq_len=0)
print(json.dumps(bad))
PY
)
good_point=$(sed -n 1p <<<"$point_json")
bad_point=$(sed -n 2p <<<"$point_json")
"$bin" run --point "$good_point" --json >"$work/point.json" 2>/dev/null && grep -q '"status":"ok"' "$work/point.json" \
  && pass || fail "run --point of a valid point did not run"
expect_refusal 2 "seq_len" run --point "$bad_point"
touch "$work/a-file"
expect_refusal 2 "--dump" run -m local -n 64 --dump "$work/a-file"
expect_refusal 2 "--dump" run -m local -n 64 --dump "$work/missing/deeper"
mkdir -p "$work/full" && touch "$work/full/x"
expect_refusal 2 "--dump" run -m local -n 64 --dump "$work/full"

# --- sweep and ab alone ------------------------------------------------------------------------
sweep=(sweep --models local --seq-lens 64 --no-measure --no-table)
expect_refusal 2 --timeout "${sweep[@]}" --out "$out/s.json" --timeout nan
expect_refusal 2 --timeout "${sweep[@]}" --out "$out/s.json" --timeout 0
expect_refusal 2 --memory-limit "${sweep[@]}" --out "$out/s.json" --memory-limit inf
expect_refusal 2 "--out -" "${sweep[@]}" --out -
expect_refusal 2 "directory" "${sweep[@]}" --out "$work"
mkfifo "$work/fifo"
expect_refusal 2 "fifo" "${sweep[@]}" --out "$work/fifo"
# --resume of another sweep's report (the CI baseline is H=2 D=16 over every model at 64,100,257).
resumed="$work/resumed.json"
cp "$valid" "$resumed"
before=$(sha256sum "$resumed")
expect_refusal 2 "--resume" sweep --models local --seq-lens 64 --no-measure --no-table --resume --out "$resumed"
[ "$(sha256sum "$resumed")" = "$before" ] && pass || fail "a refused --resume changed the report"
ab=(ab --models local --seq-lens 64)
expect_refusal 2 --rounds "${ab[@]}" --rounds 1
expect_refusal 2 --rounds "${ab[@]}" --rounds 61
expect_refusal 2 --alpha "${ab[@]}" --alpha nan
expect_refusal 2 --max-slowdown "${ab[@]}" --max-slowdown 5
expect_refusal 2 "--out -" "${ab[@]}" --out -
expect_refusal 2 --threads env --threads -3
expect_refusal 2 --threads env --threads 5000
expect_refusal 2 "unknown command 'bogus'" bogus
expect_refusal 2 "unknown command 'bogus'" -q bogus --models local

# --- what succeeds, and how sweeps whose points fail end -------------------------------------------
"$bin" --version | grep -qE "^xfbench [0-9.]+ \(commit [^,]+, [A-Za-z]+ build\)$" && pass || fail "xfbench --version"
"$bin" sweep --models local --seq-lens 64,128 "${quick[@]}" --min-time 30 --timeout 0.001 --no-measure --no-table \
  --out "$work/failed.json" >/dev/null 2>"$work/failed.err"
[ $? -eq 3 ] && grep -q "no point of the sweep succeeded" "$work/failed.err" && pass \
  || fail "a sweep whose every point failed did not exit 3: $(tail -2 "$work/failed.err")"
"$bin" sweep --models vanilla --seq-lens 64,400000 "${quick[@]}" --min-time 0 --no-measure --no-table --fail-on-error \
  --out "$work/some.json" >/dev/null 2>"$work/some.err"
[ $? -eq 1 ] && grep -q "fail-on-error" "$work/some.err" && [ "$(grep -c '"status": "ok"' "$work/some.json")" -eq 1 ] \
  && pass || fail "--fail-on-error did not fail a sweep with one failed point: $(tail -2 "$work/some.err")"
"$bin" sweep --models local --seq-lens 64 "${quick[@]}" --max-reps 3 --min-time 10 --no-measure --no-table \
  --out "$work/reps.json" >/dev/null 2>&1
python3 - "$work/reps.json" <<'PY' && pass || fail "--max-reps did not reach the sweep's child"
import json, sys
r = json.load(open(sys.argv[1]))
row = r["results"][0]
assert r["settings"]["max_reps"] == 3, r["settings"]
assert len(row["samples_ns"]) + len(row["contended_samples_ns"]) <= 3, row["samples_ns"]
assert "--max-reps 3" in row["reproducer"], row["reproducer"]
PY

echo "$passes passed, $failures failed"
[ "$failures" -eq 0 ]
