#!/usr/bin/env bash
# What a sweep runs, end to end: model selection (globs, classes, exclusions, spaces), lengths
# written 1K, grids of point fields and parameters (rows, keys, settings, tables), merge of separate
# runs at different thread counts, the dry run (lists, runs nothing, writes nothing) and progress
# (each landed point's median; silenced by -q).
#   tests/cli/cli_grid_test.sh XFBENCH
set -u
bin="$1"
src="$(cd "$(dirname "$0")/../.." && pwd)"
source "$src/tests/cli/common.sh"

tiny=(--heads 2 --head-dim 16 --min-reps 1 --min-time 0 --no-measure --no-table)

# --- dry run -------------------------------------------------------------------------------------
"$bin" sweep --dry-run --models ' vanilla , local' --seq-lens 1K,2K --heads 2 --head-dim 16 --threads 1,2 \
  --memory-limit 0.02 >"$work/dry.txt" 2>"$work/dry.err"
code=$?
python3 - "$work/dry.txt" <<'PY' && [ $code -eq 0 ] && [ -z "$(ls -A "$out")" ] && pass \
  || fail "sweep --dry-run (exit $code): $(cat "$work/dry.txt" "$work/dry.err" | head -20)"
import sys
text = open(sys.argv[1]).read()
lines = [l for l in text.splitlines() if l.strip()]
assert "dry run: 8 points; 6 would run" in text, text
assert "2 skipped over --memory-limit, 0 unsupported; nothing was run" in text, text
rows = [l.split() for l in lines[2:-1]]
assert [r[1] for r in rows] == ["vanilla"] * 4 + ["local"] * 4, rows
assert [r[2] for r in rows] == ["1024", "2048"] * 4, rows
assert sum("skipped:" in l for l in lines) == 2 and all("vanilla" in l for l in lines if "skipped:" in l), text
PY
expect_refusal 2 "removes every model" sweep --dry-run --models 'v*' --exclude vanilla
expect_refusal 2 "selects no implemented model" sweep --dry-run --models 'local,zz*'
expect_refusal 2 "--seq-lens" sweep --dry-run --models local --seq-lens 1.5K
expect_refusal 2 "--out is required" sweep --models local --seq-lens 64

# --- a grid that runs: parameters × threads --------------------------------------------------------
"$bin" sweep --models 'local' --seq-lens 64 "${tiny[@]}" -p block=16,32 --threads 1,2 --out "$work/grid.json" \
  >/dev/null 2>"$work/grid.err"
python3 - "$work/grid.json" <<'PY' && pass || fail "a parameter × threads grid: $(tail -3 "$work/grid.err")"
import json, sys
r = json.load(open(sys.argv[1]))
rows = r["results"]
got = sorted((row["threads"], row["params"]["block"]) for row in rows)
assert got == [(1, 16), (1, 32), (2, 16), (2, 32)], got
assert all(row["status"] == "ok" for row in rows), [row["reason"] for row in rows]
assert r["settings"]["threads"] == [1, 2] and r["settings"]["params"] == ["block=16,32"], r["settings"]
assert r["context"]["threads"] == 2, r["context"]["threads"]
assert all("--threads %d" % row["threads"] in row["reproducer"] for row in rows)
PY
"$bin" table "$work/grid.json" >"$work/grid.txt" 2>&1
[ "$(grep -c 'local (block=16)' "$work/grid.txt")" -eq 2 ] && [ "$(grep -c 'threads=' "$work/grid.txt")" -eq 2 ] && pass \
  || fail "the grid's table splits by threads and labels the parameter sets: $(cat "$work/grid.txt")"

"$bin" plot "$work/grid.json" --out "$work/grid.svg" 2>/dev/null && grep -q "threads=1" "$work/grid.svg" \
  && grep -q "threads=2" "$work/grid.svg" && pass || fail "the grid's plot has a panel per thread count"

# --- separate runs at different thread counts merge; a differing non-grid setting does not --------
"$bin" sweep --models vanilla --seq-lens 1K "${tiny[@]}" --threads 1 --out "$work/t1.json" >/dev/null 2>&1
"$bin" sweep --models vanilla --seq-lens 1K "${tiny[@]}" --threads 2 --out "$work/t2.json" >/dev/null 2>&1
"$bin" merge "$work/t1.json" "$work/t2.json" -o "$work/merged.json" 2>"$work/merge.err"
python3 - "$work/merged.json" <<'PY' && pass || fail "merge of two thread counts: $(cat "$work/merge.err")"
import json, sys
r = json.load(open(sys.argv[1]))
assert sorted(row["threads"] for row in r["results"]) == [1, 2]
assert r["settings"]["threads"] == [1, 2] and r["settings"]["seq_lens"] == [1024], r["settings"]
PY
"$bin" sweep --models local --seq-lens 1K "${tiny[@]}" --threads 1 --timeout 50 --out "$work/t3.json" >/dev/null 2>&1
expect_refusal 2 "settings differ in timeout_s" merge "$work/t1.json" "$work/t3.json" -o "$out/m.json"

# --- progress: each landed point's median, silenced by -q; no colour off a terminal ----------------
"$bin" sweep --models local --seq-lens 64,128 "${tiny[@]}" --out "$work/p.json" >/dev/null 2>"$work/p.err"
[ "$(grep -c '^\[[12]/2\] local' "$work/p.err")" -eq 2 ] && [ "$(grep -cE 'median( ~)?: .* samples\), .* GFLOP/s' "$work/p.err")" -eq 2 ] \
  && ! grep -q $'\033' "$work/p.err" && pass || fail "progress lines: $(cat "$work/p.err")"
"$bin" -q sweep --models local --seq-lens 64 "${tiny[@]}" --out "$work/q.json" >/dev/null 2>"$work/q.err"
# (warnings stay: a contended point on a loaded host is reported even with -q)
! grep -qE '^\[1/1\]|median( ~)?:' "$work/q.err" && pass || fail "-q did not silence the progress: $(cat "$work/q.err")"

# --- lengths with K wherever a length is -----------------------------------------------------------
"$bin" run --model local --seq-len 1K --decode-tokens 1k --pass decode --heads 2 --head-dim 16 --min-reps 1 \
  --min-time 0 --json >"$work/k.json" 2>/dev/null
python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); assert r["seq_len"] == 1024 and r["decode_tokens"] == 1024, r' \
  "$work/k.json" && pass || fail "run --seq-len 1K --decode-tokens 1k"

echo "$passes passed, $failures failed"
[ "$failures" -eq 0 ]
