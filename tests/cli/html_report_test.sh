#!/usr/bin/env bash
# `xfbench report`: the page of a small real sweep and of a report with hostile strings (structure,
# escaping, self-containment), the usual refusals, and the page in a real headless browser
# (Chromium: no console error, the script set up sorting, a click sorts, a screenshot shows the
# table and a plot). Without chromium the browser part is skipped with a message (tools/install_deps.sh
# installs it, so CI runs it).   tests/cli/html_report_test.sh XFBENCH
set -u
bin="$1"
src="$(cd "$(dirname "$0")/../.." && pwd)"
source "$src/tests/cli/common.sh"
check="$src/tests/cli/html_report_check.py"

# --- a small real sweep: forward and decode, causal, with unsupported and skipped rows ---------
# (linformer cannot decode: unsupported; the memory limit, 220 KiB, is above every forward point's
# estimate and below vanilla's and exact-tiled's decode at N=128: skipped).
"$bin" -q sweep --models vanilla,exact-tiled,local,linformer --seq-lens 64,128 --heads 2 --head-dim 16 \
  --threads 1 --min-reps 3 --min-time 0 --causal --pass forward,decode --decode-tokens 4 --memory-limit 0.00021 \
  --no-measure --no-table --out "$work/sweep.json" 2>"$work/sweep.err"
[ $? -eq 0 ] && pass || fail "the sweep failed: $(tail -3 "$work/sweep.err")"

# --- a report with hostile strings: a model name and a reason with markup and a URL ------------
python3 - "$valid" "$work/hostile.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
r["results"][0]["model"] = 'x<b>&"\'y'
r["results"][1].update(status="error", reason='<script>alert(1)</script> & "q" https://example.com/x')
r["context"]["host"] = "<img src=https://example.com/h.png>"
json.dump(r, open(sys.argv[2], "w"))
EOF

page="$work/page.html"
"$bin" report "$work/sweep.json" "$work/hostile.json" --out "$page" >"$work/stdout" 2>"$work/stderr"
[ $? -eq 0 ] && [ ! -s "$work/stdout" ] && pass || fail "report exited non-zero or printed: $(cat "$work/stderr")"
python3 "$check" page "$page" time speedup memory memory-ratio gflops crossover front state && pass || fail "page structure"
# --csv: the tidy CSV of every row of both reports beside the page, a report column first.
"$bin" report "$work/sweep.json" "$work/hostile.json" --out "$work/page2.html" --csv "$work/rows.csv" 2>"$work/stderr"
python3 - "$work/rows.csv" "$work/sweep.json" "$work/hostile.json" <<'PY' && pass || fail "report --csv: $(cat "$work/stderr")"
import csv, json, sys
rows = list(csv.DictReader(open(sys.argv[1], newline="")))
expected = len(json.load(open(sys.argv[2]))["results"]) + len(json.load(open(sys.argv[3]))["results"])
assert len(rows) == expected, (len(rows), expected)
assert set(rows[0]) >= {"report", "model", "median_ns", "p10_ns", "p90_ns", "status"}, rows[0].keys()
assert rows[0]["report"].endswith("sweep.json") and rows[-1]["report"].endswith("hostile.json")
PY
expect_refusal 2 "is also --out" report "$valid" --out "$out/r.html" --csv "$out/r.html"
# Escaped where they appear, never as markup.
grep -qF '<script>alert' "$page" && fail "a reason's markup reached the page unescaped" || pass
grep -qF '&lt;script&gt;alert(1)&lt;/script&gt; &amp; &quot;q&quot; https://example.com/x' "$page" \
  && pass || fail "the hostile reason is not shown escaped"
grep -qF 'x&lt;b&gt;&amp;&quot;&apos;y' "$page" && pass || fail "the hostile model name is not shown escaped"
grep -qF '<img' "$page" && fail "a context string became an element" || pass
grep -q 'class="xr-warnings"' "$page" && grep -q '>unsupported<' "$page" && grep -q '>skipped<' "$page" \
  && grep -q '>error<' "$page" && pass || fail "the warnings table lacks unsupported, skipped or error rows"
"$bin" report "$work/sweep.json" -o - >"$work/stdout.html" 2>"$work/stderr" && cmp -s "$work/stdout.html" \
  <("$bin" report "$work/sweep.json" -o - 2>/dev/null) && grep -q '^<!DOCTYPE html>' "$work/stdout.html" \
  && pass || fail "report -o - does not print the same page twice"

# --- refusals: exit 2, one line, nothing written ----------------------------------------------
expect_refusal 2 "--out" report "$valid"
expect_refusal 2 "missing.json" report "$work/missing.json" --out "$out/r.html"
echo '{"not": "a report"}' >"$work/other.json"
expect_refusal 2 "other.json" report "$work/other.json" --out "$out/r.html"
expect_refusal 2 "$out" report "$valid" --out "$out"
expect_refusal 2 ".html" report "$valid" --out "$out/r.svg"
expect_refusal 2 "$valid" report "$valid" --out "$valid"
expect_refusal 2 "--baseline" report "$valid" --baseline nosuch --out "$out/r.html"
expect_refusal 2 "other.json" report "$valid" "$work/other.json" --out "$out/r.html"

# --- a real browser ------------------------------------------------------------------------------
browser=$(command -v chromium || command -v chromium-browser || true)
if [ -z "$browser" ]; then
  echo "SKIP: the headless browser test: chromium is not installed (tools/install_deps.sh installs it)"
else
  # chrome FILE.html OUT ARGS…: the page in headless Chromium; stdout to OUT, the log to OUT.log.
  chrome() {
    local file=$1 output=$2
    shift 2
    timeout 120 "$browser" --headless --no-sandbox --disable-gpu --no-first-run --disable-extensions \
      --user-data-dir="$work/chrome" --enable-logging=stderr --v=0 "$@" "file://$file" >"$output" 2>"$output.log"
  }
  # console_errors LOG: the lines of a Chromium log that report a script error or a refused load.
  console_errors() { grep -E "Uncaught|CONSOLE.*[Ee]rror|Refused to|Failed to load|ERR_" "$1" || true; }

  # The check itself must see an error: a page whose script throws.
  printf '<!DOCTYPE html><html><body><script>undefined_function();</script></body></html>\n' >"$work/broken.html"
  chrome "$work/broken.html" "$work/broken.dom" --dump-dom
  [ -n "$(console_errors "$work/broken.dom.log")" ] && pass \
    || fail "a throwing script left no trace in Chromium's log: $(tail -5 "$work/broken.dom.log")"

  chrome "$page" "$work/page.dom" --dump-dom
  [ $? -eq 0 ] && [ -s "$work/page.dom" ] && pass || fail "chromium --dump-dom failed: $(tail -5 "$work/page.dom.log")"
  errors=$(console_errors "$work/page.dom.log")
  [ -z "$errors" ] && pass || fail "console errors in the report page: $errors"
  python3 "$check" dom "$work/page.dom" && pass || fail "the DOM after the script ran"

  # A click on a length's header sorts the time table by it, cells without a value last.
  "$bin" report "$work/sweep.json" --out "$work/sweep-page.html" && pass || fail "report of the sweep alone"
  sed 's|</body>|<script>Array.prototype.forEach.call(document.querySelectorAll("div[data-metric=time] th"), function (th) { if (th.textContent === "N=128") th.click(); });</script></body>|' \
    "$work/sweep-page.html" >"$work/clicked.html"
  chrome "$work/clicked.html" "$work/clicked.dom" --dump-dom
  python3 "$check" sorted "$work/clicked.dom" "N=128" && pass || fail "a click on N=128 did not sort the time table"

  chrome "$work/sweep-page.html" "$work/shot.out" --hide-scrollbars --force-device-scale-factor=1 \
    --window-size=1200,1800 --screenshot="$work/shot.png"
  [ -s "$work/shot.png" ] && pass || fail "no screenshot: $(tail -5 "$work/shot.out.log")"
  python3 "$check" pixels "$work/shot.png" "$work/sweep-page.html" && pass || fail "the screenshot"
  # The pixel check must fail on the same page without its plots.
  python3 -c 'import re, sys; open(sys.argv[2], "w").write(re.sub(r"<figure class=\"xr-plot\">.*?</figure>", "",
    open(sys.argv[1]).read(), flags=re.S))' "$work/sweep-page.html" "$work/noplot.html"
  chrome "$work/noplot.html" "$work/noplot.out" --hide-scrollbars --force-device-scale-factor=1 \
    --window-size=1200,1800 --screenshot="$work/noplot.png"
  python3 "$check" pixels "$work/noplot.png" "$work/sweep-page.html" >/dev/null \
    && fail "the pixel check passed on a page without plots" || pass
fi

echo "html report tests: $passes passed, $failures failed"
[ "$failures" -eq 0 ]
