#!/usr/bin/env bash
# Careless and hostile inputs against every command that reads a report, outputs that must not
# clobber anything, and gates that must not pass by accident. Every refused input: exit 2, one
# stderr line naming the file and the field (or the option), nothing on stdout, no file created,
# inputs unchanged.   tests/cli/cli_reports_test.sh XFBENCH
set -u
bin="$1"
src="$(cd "$(dirname "$0")/../.." && pwd)"
source "$src/tests/cli/common.sh"
mkdir -p "$work/hostile"

# Every command that reads a report, with REPORT standing for the hostile file.
reading_commands=(
  "table REPORT" "table REPORT --format md" "table REPORT --format csv" "table REPORT --format github-benchmark"
  "table REPORT --format bmf" "table REPORT --complexity" "table REPORT --paper lra" "table REPORT --metric speedup"
  "plot REPORT --out $out/p.svg" "compare REPORT $valid" "compare $valid REPORT" "merge REPORT -o $out/m.json"
  "merge $valid REPORT -o $out/m.json" "complexity REPORT" "complexity REPORT --format json"
)

# refuse_everywhere FILE NEEDLE: every reading command refuses FILE, naming NEEDLE.
refuse_everywhere() {
  local file=$1 needle=$2 command
  local sum_before
  sum_before=$(digest "$file")
  for command in "${reading_commands[@]}"; do
    # shellcheck disable=SC2086
    expect_refusal 2 "$needle" ${command//REPORT/$file}
  done
  [ "$(digest "$file")" = "$sum_before" ] && pass || fail "a command changed $file"
}

# --- hostile reports: NAME | python statement on the report r (row x = r["results"][0]) | needle ---
cases=(
  'tool-wrong|r["tool"] = "other"|tool'
  'tool-ab|r["tool"] = "xfbench ab"|tool'
  'tool-missing|del r["tool"]|tool'
  'schema-string|r["schema_version"] = "1"|schema_version'
  'schema-huge|r["schema_version"] = 10**30|schema_version'
  'schema-negative|r["schema_version"] = -1|schema_version'
  'schema-zero|r["schema_version"] = 0|schema_version'
  'schema-float|r["schema_version"] = 1.0|schema_version'
  'schema-future|r["schema_version"] = 2|schema_version'
  'context-array|r["context"] = []|context'
  'context-missing|del r["context"]|context'
  'settings-string|r["settings"] = "x"|settings'
  'results-object|r["results"] = {}|results'
  'results-missing|del r["results"]|results'
  'row-number|r["results"][0] = 5|results[0]'
  'row-array|r["results"][1] = [1, 2]|results[1]'
  'seq-len-zero|x["seq_len"] = 0|results[0].seq_len'
  'seq-len-negative|x["seq_len"] = -1|results[0].seq_len'
  'seq-len-huge|x["seq_len"] = 1e300|results[0].seq_len'
  'seq-len-string|x["seq_len"] = "64"|results[0].seq_len'
  'seq-len-null|x["seq_len"] = None|results[0].seq_len'
  'seq-len-float|x["seq_len"] = 64.5|results[0].seq_len'
  'seq-len-bool|x["seq_len"] = True|results[0].seq_len'
  'seq-len-2^41|x["seq_len"] = 2**41|results[0].seq_len'
  'seq-len-2^70|x["seq_len"] = 2**70|results[0].seq_len'
  'batch-zero|r["results"][7]["batch"] = 0|results[7].batch'
  'heads-negative|x["heads"] = -3|results[0].heads'
  'head-dim-object|x["head_dim"] = {}|results[0].head_dim'
  'sizes-overflow|x.update(batch=2**30, heads=2**30, seq_len=2**30, head_dim=2**30)|overflows'
  'median-nan-string|x["median_ns"] = "NaN"|results[0].median_ns'
  'median-negative|x["median_ns"] = -1|results[0].median_ns'
  'median-zero-ok|x["median_ns"] = 0|results[0].median_ns'
  'median-huge|x["median_ns"] = 1e300|results[0].median_ns'
  'min-above-median|x["min_ns"] = x["median_ns"] * 2|results[0].min_ns'
  'max-below-median|x["max_ns"] = x["median_ns"] / 2|results[0].max_ns'
  'samples-empty-ok|x["samples_ns"] = []|results[0].samples_ns'
  'samples-negative|x["samples_ns"][0] = -5|results[0].samples_ns[0]'
  'samples-string|x["samples_ns"] = "many"|results[0].samples_ns'
  'samples-nested|x["samples_ns"] = [[1]]|results[0].samples_ns[0]'
  'cv-string|x["cv"] = "low"|results[0].cv'
  'cpu-ratio-negative|x["cpu_ratio"] = -0.5|results[0].cpu_ratio'
  'host-busy-above-1|x["host_busy"] = 7|results[0].host_busy'
  'flops-negative|x["flops"] = -1|results[0].flops'
  'flops-float|x["flops"] = 1.5|results[0].flops'
  'owned-below-minus-1|x["peak_owned_bytes"] = -2|results[0].peak_owned_bytes'
  'tensor-bytes-huge|x["peak_tensor_bytes"] = 2**64|results[0].peak_tensor_bytes'
  'status-bogus|x["status"] = "bogus"|results[0].status'
  'status-number|x["status"] = 1|results[0].status'
  'scope-bogus|x["scope"] = "galaxy"|results[0].scope'
  'pass-bogus|x["pass"] = "sideways"|results[0].pass'
  'model-empty|x["model"] = ""|results[0].model'
  'model-number|x["model"] = 7|results[0].model'
  'model-newline|x["model"] = "vanilla\nxfbench: ok"|results[0].model'
  'model-long|x["model"] = "m" * 100000|results[0].model'
  'causal-string|x["causal"] = "yes"|results[0].causal'
  'params-array|x["params"] = [1, 2]|results[0].params'
  'params-nested|x["params"] = {"a": {"b": [1, [2]]}}|results[0].params.a'
  'stage-string|x["stage_median_ns"] = {"route": "fast"}|results[0].stage_median_ns.route'
  'warnings-number|x["warnings"] = [1]|results[0].warnings[0]'
  'missing-reproducer|del x["reproducer"]|results[0].reproducer'
  'missing-median|del r["results"][3]["median_ns"]|results[3].median_ns'
  'missing-status|del x["status"]|results[0].status'
  'context-peak-string|r["context"]["fma_peak_gflops"] = "fast"|context.fma_peak_gflops'
  'context-contended-string|r["context"]["machine_contended"] = "yes"|context.machine_contended'
  'context-contended-by-threads|r["context"]["machine_by_threads"] = {"2": {"machine_contended": 1}}|machine_by_threads.2.machine_contended'
  'context-host-number|r["context"]["host"] = 5|context.host'
  'settings-shard-number|r["settings"]["shard"] = 3|settings.shard'
)
for entry in "${cases[@]}"; do
  IFS='|' read -r name statement needle <<<"$entry"
  python3 - "$valid" "$work/hostile/$name.json" "$statement" <<'PY' || fail "cannot doctor case $name"
import json, sys
r = json.load(open(sys.argv[1]))
x = r["results"][0]
exec(sys.argv[3])
json.dump(r, open(sys.argv[2], "w"), indent=1)
PY
  refuse_everywhere "$work/hostile/$name.json" "$needle"
done

# Raw text the JSON writer would not produce.
sed '0,/"median_ns": [0-9.e+]*/s//"median_ns": 1e400/' "$valid" >"$work/hostile/number-overflow.json"
refuse_everywhere "$work/hostile/number-overflow.json" "number-overflow.json"
python3 -c 'print("[" * 100000 + "]" * 100000)' >"$work/hostile/deep.json"
refuse_everywhere "$work/hostile/deep.json" "nesting"
python3 - "$valid" "$work/hostile/deep-params.json" <<'PY'
import json, sys
text = open(sys.argv[1]).read().replace('"params": {', '"params": {"deep": ' + "[" * 5000 + "]" * 5000 + ", ", 1)
open(sys.argv[2], "w").write(text)
PY
refuse_everywhere "$work/hostile/deep-params.json" "nesting"
# A key twice in one object (the parser would keep the last): in a row, and at the top level.
python3 - "$valid" "$work/hostile/duplicate-key.json" "$work/hostile/duplicate-top.json" <<'PY'
import sys
text = open(sys.argv[1]).read()
open(sys.argv[2], "w").write(text.replace('"model": ', '"model": "vanilla", "model": ', 1))
open(sys.argv[3], "w").write(text.replace("{", '{"schema_version": 0, ', 1))
PY
refuse_everywhere "$work/hostile/duplicate-key.json" 'the key "model" appears twice'
refuse_everywhere "$work/hostile/duplicate-top.json" 'the key "schema_version" appears twice'
echo "{ broken" >"$work/hostile/broken.json"
refuse_everywhere "$work/hostile/broken.json" "not valid JSON"
head -c 4096 /dev/urandom >"$work/hostile/random.bin"
refuse_everywhere "$work/hostile/random.bin" "random.bin"
printf '\xff\xfe{"tool": "xfbench"}' >"$work/hostile/bad-utf8.json"
refuse_everywhere "$work/hostile/bad-utf8.json" "not valid JSON"
echo '[]' >"$work/hostile/array.json"
refuse_everywhere "$work/hostile/array.json" "array.json"
: >"$work/hostile/empty.json"
refuse_everywhere "$work/hostile/empty.json" "is empty"
mkdir "$work/hostile/folder.json"
refuse_everywhere "$work/hostile/folder.json" "is a directory"
mkfifo "$work/hostile/fifo.json"
refuse_everywhere "$work/hostile/fifo.json" "not a regular file"
truncate -s 300M "$work/hostile/huge.json"
refuse_everywhere "$work/hostile/huge.json" "MiB"
refuse_everywhere "$work/hostile/nosuch.json" "no such file"
refuse_everywhere /dev/null "not a regular file"

# --- unknown models: readable, but refused where registry facts are needed -----------------------
python3 - "$valid" "$work/unknown.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
r["results"][4]["model"] = "nosuch-model"
json.dump(r, open(sys.argv[2], "w"))
PY
"$bin" table "$work/unknown.json" >"$work/stdout" 2>/dev/null && grep -q "nosuch-model" "$work/stdout" \
  && pass || fail "table of a report with an unknown model"
for command in "table REPORT --complexity" "complexity REPORT" "table REPORT --paper lra"; do
  # shellcheck disable=SC2086
  expect_refusal 2 "results[4].model: unknown model \"nosuch-model\"" ${command//REPORT/$work/unknown.json}
done

# --- the valid report passes every reading command (the refusals above are not blanket) -------
for command in "table REPORT" "table REPORT --format csv" "table REPORT --format bmf" "table REPORT --complexity" \
               "table REPORT --metric speedup" "complexity REPORT" "compare REPORT REPORT"; do
  # shellcheck disable=SC2086
  "$bin" ${command//REPORT/$valid} >"$work/stdout" 2>"$work/stderr" && [ -s "$work/stdout" ] \
    && ! grep -qiE "(^|[^a-z])-?(nan|inf)([^a-z]|$)" "$work/stdout" \
    && pass || fail "xfbench $command on a valid report: $(head -c 300 "$work/stderr")"
done

# --- outputs that never clobber ------------------------------------------------------------------
mkdir "$work/adir"
ln -s "$valid" "$work/link-to-input.svg"
ln -s "$work/adir" "$work/link-to-dir.svg"
ln -s "$work/nowhere/x.svg" "$work/dangling.svg"
mkfifo "$work/fifo.svg"
cp "$valid" "$work/other.json"
ln "$work/other.json" "$work/hardlink.json"
expect_refusal 2 "is the input" plot "$valid" --out "$valid"
expect_refusal 2 "svg" plot "$valid" --out "$out/p.png"
expect_refusal 2 "is the input" plot "$valid" --out "$work/link-to-input.svg"
expect_refusal 2 "is a directory" plot "$valid" --out "$work/adir"
expect_refusal 2 "is a directory" plot "$valid" --out "$work/link-to-dir.svg"
expect_refusal 2 "dangling" plot "$valid" --out "$work/dangling.svg"
expect_refusal 2 "not a regular file" plot "$valid" --out "$work/fifo.svg"
expect_refusal 2 "does not exist" plot "$valid" --out "$work/missing/p.svg"
expect_refusal 2 "is the input" merge "$valid" -o "$valid"
expect_refusal 2 "is the input" merge "$work/other.json" -o "$work/hardlink.json"
expect_refusal 2 "is a directory" merge "$valid" -o "$work/adir"
expect_refusal 2 "not a regular file" merge "$valid" -o "$work/fifo.svg"
expect_refusal 2 "is a directory" taxonomy --format svg --out "$work/adir"
[ -z "$(ls -A "$work/adir")" ] && [ ! -e "$work/nowhere" ] && pass || fail "a refused output wrote something"
"$bin" plot "$valid" --out - >"$work/stdout" 2>/dev/null && head -1 "$work/stdout" | grep -q '^<?xml' \
  && [ -z "$(ls -A "$out")" ] && pass || fail "plot --out - writes the SVG to standard output"
"$bin" merge "$valid" -o - >"$work/stdout" 2>"$work/stderr" \
  && python3 -c 'import json, sys; assert len(json.load(open(sys.argv[1]))["results"]) == len(json.load(open(sys.argv[2]))["results"])' "$work/stdout" "$valid" \
  && grep -q "standard output" "$work/stderr" && pass || fail "merge -o - writes the report to standard output"
"$bin" plot "$valid" --out "$work/target.svg" && cp "$work/target.svg" "$work/first.svg" && ln -s "$work/target.svg" "$work/link.svg" \
  && "$bin" plot "$valid" --metric memory --out "$work/link.svg" && [ -L "$work/link.svg" ] && ! cmp -s "$work/target.svg" "$work/first.svg" \
  && pass || fail "plot --out a symbolic link to a regular file replaces its target, keeping the link"
# A folder that exists but takes no new file (procfs) is not called missing.
expect_refusal 2 "cannot write in folder /proc" plot "$valid" --out /proc/xfbench-test.svg
# A write that fails (file size limit) leaves the old content and no temporary behind.
echo "old content" >"$out/kept.svg"
(ulimit -f 1; "$bin" plot "$valid" --out "$out/kept.svg" >/dev/null 2>"$work/stderr")
code=$?
[ "$code" -eq 3 ] && [ "$(error_lines "$work/stderr")" -eq 1 ] && [ "$(cat "$out/kept.svg")" = "old content" ] \
  && [ "$(ls -A "$out")" = "kept.svg" ] && pass || fail "a failed write (exit $code): $(cat "$work/stderr"); $(ls -A "$out")"
rm -f "$out/kept.svg"

# --- gates that cannot pass by accident ------------------------------------------------------------
python3 - "$valid" "$work/shifted.json" "$work/skipped.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for x in r["results"]:
    x["seq_len"] += 1
json.dump(r, open(sys.argv[2], "w"))
r = json.load(open(sys.argv[1]))
for x in r["results"]:
    x.update(status="skipped", reason="memory", samples_ns=[], median_ns=0, min_ns=0, max_ns=0)
json.dump(r, open(sys.argv[3], "w"))
PY
for pair in "$valid $work/shifted.json" "$work/skipped.json $work/skipped.json"; do
  # shellcheck disable=SC2086
  "$bin" compare $pair --metrics memory,flops >"$work/stdout" 2>"$work/stderr"
  code=$?
  [ "$code" -eq 1 ] && grep -q "nothing compared" "$work/stderr" && pass || fail "compare $pair compared nothing and exited $code"
done
"$bin" compare "$valid" "$valid" --metrics memory,flops >/dev/null 2>&1 && pass || fail "compare of a report with itself"
expect_refusal 2 "--max-slowdown" compare "$valid" "$valid" --max-slowdown 5
expect_refusal 2 "5%" compare "$valid" "$valid" --max-slowdown 5
expect_refusal 2 "--max-slowdown" compare "$valid" "$valid" --max-slowdown=-1%
expect_refusal 2 "--max-slowdown" compare "$valid" "$valid" --max-slowdown nan
expect_refusal 2 "--max-slowdown" compare "$valid" "$valid" --max-slowdown inf%
expect_refusal 2 "--max-memory-growth" compare "$valid" "$valid" --max-memory-growth 2
# Numbers are decimal, without spaces, as every option of a point reads them: no hex, no padding.
expect_refusal 2 "--max-slowdown" compare "$valid" "$valid" --max-slowdown " 5%"
expect_refusal 2 "--max-slowdown" compare "$valid" "$valid" --max-slowdown 0x10%
expect_refusal 2 "--alpha" compare "$valid" "$valid" --alpha 0x1p-2
expect_refusal 2 "--alpha" compare "$valid" "$valid" --alpha " 0.5"
expect_refusal 2 "--alpha" compare "$valid" "$valid" --alpha 1e-300
expect_refusal 2 "not a decimal number" compare "$valid" "$valid" --max-slowdown 1e400
# A subnormal is a number (from_chars alone calls it out of range): as small a threshold as asked.
"$bin" compare "$valid" "$valid" --max-slowdown 1e-320 --metrics memory,flops >/dev/null 2>&1 \
  && pass || fail "a subnormal threshold is a number"
expect_refusal 2 "floor" run -m rfa -n 64 -p floor=0x10
expect_refusal 2 "floor" run -m rfa -n 64 -p "floor= 0.5"
"$bin" compare "$valid" "$valid" --max-slowdown 0.05 --max-memory-growth 150% --metrics memory,flops >/dev/null 2>&1 \
  && pass || fail "a fraction and a percentage above 100% are accepted"
expect_refusal 2 "--baseline \"nosuch\"" table "$valid" --baseline nosuch
expect_refusal 2 "--baseline" table "$valid" --metric speedup --baseline nosuch
expect_refusal 2 "--baseline" plot "$valid" --metric speedup --baseline nosuch --out "$out/p.svg"
python3 - "$valid" "$work/noisy.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for x in r["results"]:
    x["contended"] = x["unstable"] = False
r["results"][0]["contended"] = True
r["results"][1]["unstable"] = True
json.dump(r, open(sys.argv[2], "w"))
PY
for format in bmf github-benchmark; do
  "$bin" table "$work/noisy.json" --format "$format" >"$work/stdout" 2>"$work/stderr" \
    && python3 - "$work/stdout" "$format" "$valid" <<'PY' && grep -q "left out 2 ok row(s).*1 contended, 1 unstable" "$work/stderr" \
    && pass || fail "table --format $format keeps contended or unstable rows: $(cat "$work/stderr")"
import json, sys
d = json.load(open(sys.argv[1]))
names = list(d) if sys.argv[2] == "bmf" else [e["name"] for e in d]
ok_rows = [x for x in json.load(open(sys.argv[3]))["results"] if x["status"] == "ok"]
assert len(names) == len(ok_rows) - 2, len(names)  # every ok row but the 2 noisy ones (others have no time)
assert not any(n.startswith("vanilla N=64 ") or n.startswith("vanilla N=100 ") for n in names), names
PY
done

echo "$passes passed, $failures failed"
[ "$failures" -eq 0 ]
