#!/usr/bin/env bash
# `table --metric crossover`, `--metric front`, `--format csv --tidy` and the crossover field of
# `complexity --format json`, end to end: the tidy CSV read back with Python's csv module (and
# pandas where installed), the front checked against one computed in Python from the report's
# JSON, a crossover at a known length, and the refusals of options that do not combine.
#   tests/cli/cli_tables_test.sh XFBENCH
set -u
bin="$1"
src="$(cd "$(dirname "$0")/../.." && pwd)"
source "$src/tests/cli/common.sh"

# A report with a reason that needs quoting, a skipped row and a parameter grid of one model.
python3 - "$valid" "$work/odd.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
rows = r["results"]
skipped = next(x for x in rows if x["model"] == "performer")
skipped.update(status="skipped", reason='estimated 5 GiB > "--memory-limit", see docs\nline two')
local = [x for x in rows if x["model"] == "local"]
local[0]["params"] = dict(local[0]["params"], block=7)
json.dump(r, open(sys.argv[2], "w"))
PY

# --- tidy CSV: Python's csv module reads one dict per row, every value as the JSON has it --------
for report in "$valid" "$work/odd.json"; do
  "$bin" table "$report" --format csv --tidy >"$work/tidy.csv" 2>"$work/stderr" \
    && python3 - "$report" "$work/tidy.csv" <<'PY' && pass || fail "tidy CSV of $report: $(tail -3 "$work/stderr")"
import csv, json, math, sys
report = json.load(open(sys.argv[1]))
with open(sys.argv[2], newline="") as f:
    reader = csv.DictReader(f)
    lines = list(reader)
    header = reader.fieldnames
for column in ["model", "class", "seq_len", "batch", "heads", "head_dim", "scope", "pass", "causal", "d_ff",
               "decode_tokens", "threads", "seed", "params", "status", "reason", "median_ns", "p10_ns", "p90_ns",
               "min_ns", "max_ns", "peak_tensor_bytes", "flops", "gflops_per_s"]:
    assert column in header, (column, header)
assert len(header) == len(set(header)), header
assert len(lines) == len(report["results"]), (len(lines), len(report["results"]))
grid = "block" in {k for x in report["results"] if x["model"] == "local" for k in x["params"]} and any(
    x["params"].get("block") == 7 for x in report["results"])
assert ("param_block" in header) == grid, header
for line, row in zip(lines, report["results"]):
    assert None not in line and None not in line.values(), line  # no ragged line
    for key in ["model", "scope", "pass", "status", "reason"]:
        assert line[key] == row[key], (key, line[key], row[key])
    for key in ["seq_len", "batch", "heads", "head_dim", "d_ff", "decode_tokens", "threads", "seed"]:
        assert int(line[key]) == row[key], (key, line[key], row[key])
    assert line["causal"] == ("true" if row["causal"] else "false")
    assert line["dtype"] == row.get("dtype", "f32"), (line["dtype"], row.get("dtype"))
    assert line["class"] == row["classes"][0]
    if row["status"] != "ok":
        assert line["median_ns"] == line["peak_tensor_bytes"] == "", line
        continue
    assert float(line["median_ns"]) == row["median_ns"]
    assert int(line["peak_tensor_bytes"]) == row["peak_tensor_bytes"]
    assert float(line["min_ns"]) <= float(line["p10_ns"]) <= float(line["p90_ns"]) <= float(line["max_ns"]), line
    if grid and row["model"] == "local":
        assert line["param_block"] == str(row["params"]["block"]), line
PY
done
if python3 -c "import pandas" 2>/dev/null; then
  "$bin" table "$work/odd.json" --format csv --tidy >"$work/tidy.csv" && python3 - "$work/tidy.csv" <<'PY' \
    && pass || fail "pandas does not read the tidy CSV as numbers"
import sys, pandas
df = pandas.read_csv(sys.argv[1])
assert df["median_ns"].dtype.kind == "f" and df["seq_len"].dtype.kind == "i", df.dtypes
assert df["causal"].dtype.kind == "b", df.dtypes
assert df.groupby("model")["median_ns"].median().notna().any()
PY
else
  echo "note: python3 pandas is not installed; the tidy CSV is checked with the csv module only"
fi

# --- front: the same models Python finds undominated in the report's JSON --------------------------
"$bin" table "$valid" --metric front --format csv >"$work/front.csv" \
  && python3 - "$valid" "$work/front.csv" <<'PY' && pass || fail "table --metric front differs from Python's front"
import csv, json, sys
rows = [x for x in json.load(open(sys.argv[1]))["results"] if x["status"] == "ok"]
want = set()
for x in rows:
    key = lambda r: [r[k] for k in ("scope", "pass", "causal", "batch", "heads", "head_dim", "d_ff", "decode_tokens", "seq_len")]
    same = [y for y in rows if key(y) == key(x)]
    t, m = x["median_ns"], x["peak_tensor_bytes"]
    if not any(y["median_ns"] <= t and y["peak_tensor_bytes"] <= m and (y["median_ns"] < t or y["peak_tensor_bytes"] < m) for y in same):
        want.add((x["seq_len"], x["model"]))
got = {(int(line["seq_len"]), line["model"]) for line in csv.DictReader(open(sys.argv[2], newline=""))}
assert got == want, (sorted(got - want), sorted(want - got))
PY

# --- crossover at a known length: exact-tiled 2× slower at N=64 and 100, 2× faster at 257 ---------
python3 - "$valid" "$work/cross.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
r["results"] = [x for x in r["results"] if x["model"] in ("vanilla", "exact-tiled")]
for x in r["results"]:
    ratio = 1 if x["model"] == "vanilla" else (0.5 if x["seq_len"] == 257 else 2)
    x["median_ns"] = float(ratio * x["seq_len"] ** 2)
    x["samples_ns"] = [x["median_ns"]]
    x["min_ns"] = x["max_ns"] = x["median_ns"]
    x["contended"] = x["unstable"] = False
json.dump(r, open(sys.argv[2], "w"))
PY
"$bin" table "$work/cross.json" --metric crossover --format csv >"$work/stdout" 2>"$work/stderr" \
  && grep -q ",exact-tiled,interpolated,160,100-257,257,false,false," "$work/stdout" \
  && grep -q ",vanilla,baseline," "$work/stdout" \
  && pass || fail "crossover of exact-tiled is not 160 (√(100·257)): $(cat "$work/stdout" "$work/stderr")"
"$bin" table "$work/cross.json" --metric crossover --baseline exact-tiled >"$work/stdout" \
  && grep -q "vanilla  *never  *never" "$work/stdout" && grep -q "exact-tiled  *baseline" "$work/stdout" \
  && pass || fail "--baseline exact-tiled (vanilla faster only below 257: never): $(cat "$work/stdout")"
"$bin" complexity "$work/cross.json" --format json >"$work/stdout" && python3 - "$work/stdout" <<'PY' \
  && pass || fail "complexity --format json: no crossover field: $(head -c 600 "$work/stdout")"
import json, sys
series = {s["model"]: s for s in json.load(open(sys.argv[1]))["series"]}
assert series["vanilla"]["crossover"] is None
c = series["exact-tiled"]["crossover"]
assert c["baseline"] == "vanilla" and c["time"]["kind"] == "interpolated" and c["time"]["seq_len"] == 160, c
assert c["time"]["between"] == [100, 257], c
PY
for format in text md; do
  "$bin" table "$valid" --metric crossover --format $format >"$work/stdout" && grep -q "baseline" "$work/stdout" \
    && "$bin" table "$valid" --metric front --format $format >"$work/stdout" && grep -q "time–memory front" "$work/stdout" \
    && pass || fail "table --metric crossover/front --format $format"
done

# --- options that do not combine ---------------------------------------------------------------------
expect_refusal 2 "--tidy needs --format csv" table "$valid" --tidy
expect_refusal 2 "--tidy needs --format csv" table "$valid" --tidy --format bmf
expect_refusal 2 "--complexity" table "$valid" --tidy --format csv --complexity
expect_refusal 2 "--complexity" table "$valid" --metric crossover --complexity
expect_refusal 2 "--baseline" table "$valid" --metric crossover --baseline nosuch
expect_refusal 2 "--baseline" complexity "$valid" --baseline nosuch
python3 -c "import json,sys; r=json.load(open(sys.argv[1])); r['results']=[x for x in r['results'] if x['model']!='vanilla']; json.dump(r,open(sys.argv[2],'w'))" \
  "$valid" "$work/novanilla.json"
expect_refusal 2 "vanilla" table "$work/novanilla.json" --metric crossover

echo "$passes passed, $failures failed"
[ "$failures" -eq 0 ]
