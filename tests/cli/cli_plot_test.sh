#!/usr/bin/env bash
# `xfbench plot` end to end on the CI baseline (25 models, forward pass): the SVG parses with
# Python's xml.etree, every model has its own colour and its class's marker, the panel title says
# "forward", the subtitle gives CPU, threads, dtype and commit; --metric gflops plots the figures
# `table --metric gflops` prints; a row with samples gets a band; --out x.png is refused.
#   tests/cli/cli_plot_test.sh XFBENCH
set -u
bin="$1"
src="$(cd "$(dirname "$0")/../.." && pwd)"
source "$src/tests/cli/common.sh"

# --- the output format: SVG only, never SVG under another name -----------------------------------
for name in p.png p.PNG p.svg.png p.pdf p; do
  expect_refusal 2 "SVG only" plot "$valid" --out "$out/$name"
done
expect_refusal 2 "SVG only" plot "$valid" --metric gflops --out "$out/p.png"

# --- colours, markers, titles, subtitle -----------------------------------------------------------
"$bin" plot "$valid" --out "$work/time.svg" && python3 - "$work/time.svg" "$valid" <<'PY' && pass || fail "plot: colours, markers, titles"
import json, sys
import xml.etree.ElementTree as ET
ns = "{http://www.w3.org/2000/svg}"
root = ET.parse(sys.argv[1]).getroot()
report = json.load(open(sys.argv[2]))
series = root.findall(f".//{ns}g[@class='series']")
models = {r["model"] for r in report["results"]}
assert {s.get("data-model") for s in series} == models, "one series per model"
assert len({s.get("stroke") for s in series}) == len(models), "a colour per model"
drawn = {r["model"] for r in report["results"] if r["status"] == "ok"}
marker = {}
for s in series:
    shapes = {p.get("d") for p in s.findall(f"{ns}path[@class='point']")}
    # A model with ok rows has its class's one marker; one with none (unsupported here) a legend entry alone.
    assert len(shapes) == (1 if s.get("data-model") in drawn else 0), s.get("data-model")
    marker.setdefault(s.get("data-class"), set()).update(shapes)
assert all(len(v) == 1 for v in marker.values()), "one marker per class"
assert len({next(iter(v)) for v in marker.values()}) == len(marker), "classes' markers differ"
titles = [t.text for t in root.iter(f"{ns}text") if t.get("class") == "title"]
assert titles and all("forward pass" in t for t in titles), titles
subtitles = [t.text for t in root.iter(f"{ns}text") if t.get("class") == "subtitle"]
context = report["context"]
want = f"CPU: {context['cpu_model']} · threads: {context['threads']} · dtype: f32 · commit {context['git_commit'][:12]}"
assert subtitles and all(s.startswith(want) for s in subtitles), (subtitles, want)
assert not root.findall(f".//{ns}path[@class='band']"), "the baseline keeps one sample per point: no band"
PY

# --- --metric gflops: the table's figures --------------------------------------------------------
"$bin" plot "$valid" --metric gflops --out "$work/gflops.svg" \
  && "$bin" table "$valid" --metric gflops --format csv >"$work/gflops.csv" \
  && python3 - "$work/gflops.svg" "$work/gflops.csv" "$valid" <<'PY' && pass || fail "plot --metric gflops"
import csv, json, sys
import xml.etree.ElementTree as ET
ns = "{http://www.w3.org/2000/svg}"
root = ET.parse(sys.argv[1]).getroot()
drawn = {}
for s in root.findall(f".//{ns}g[@class='series']"):
    for p in s.findall(f"{ns}path[@class='point']"):
        drawn[(s.get("data-model"), int(p.get("data-n")))] = float(p.get("data-value"))
report = json.load(open(sys.argv[3]))
ok = {(r["model"], r["seq_len"]): r["gflops_per_s"] for r in report["results"] if r["status"] == "ok"}
assert drawn.keys() == ok.keys(), sorted(set(drawn) ^ set(ok))
for key, value in ok.items():
    assert abs(drawn[key] - value) <= 1e-5 * value, (key, drawn[key], value)
rows = list(csv.reader(open(sys.argv[2])))
header = rows[0]
checked = 0
model = header.index("model")
for line in rows[1:]:
    for column, cell in zip(header, line):
        key = (line[model], int(column[2:])) if column.startswith("N=") else None
        if key in drawn:
            assert f"{drawn[key]:.1f}" == cell.split()[0], (key, cell)
            checked += 1
assert checked == len(ok), (checked, len(ok))
titles = [t.text for t in root.iter(f"{ns}text") if t.get("class") == "title"]
assert all(t.startswith("Executed GFLOP/s — attention, forward pass") for t in titles), titles
PY

# --- a row with samples has a band ----------------------------------------------------------------
python3 - "$valid" "$work/samples.json" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
row = next(r for r in report["results"] if r["model"] == "vanilla" and r["status"] == "ok")
m = row["median_ns"]
row["samples_ns"] = [0.9 * m, m, 1.2 * m]
json.dump(report, open(sys.argv[2], "w"))
PY
"$bin" plot "$work/samples.json" --out "$work/band.svg" && python3 - "$work/band.svg" <<'PY' && pass || fail "plot: a band where a row has samples"
import sys
import xml.etree.ElementTree as ET
ns = "{http://www.w3.org/2000/svg}"
root = ET.parse(sys.argv[1]).getroot()
bands = {s.get("data-model"): s.findall(f"{ns}path[@class='band']") for s in root.findall(f".//{ns}g[@class='series']")}
assert len(bands["vanilla"]) >= 1 and sum(map(len, bands.values())) == len(bands["vanilla"]), bands
PY

echo "$passes passed, $failures failed"
[ "$failures" -eq 0 ]
