# Doctoring of pretty-printed reports for the command-line tests (tests/cli/cli_test.sh,
# tests/cli/ci_gate_test.sh): filters from stdin to stdout, each changing one kind of field so that a
# comparison has a known answer.

# scale_times FACTOR: every timing sample, median, min and max multiplied (pretty-printed reports
# have one sample per line inside "samples_ns": [ … ]).
scale_times() {
  awk -v f="$1" '
    /"samples_ns": \[$/ { inside = 1; print; next }
    inside && /\]/ { inside = 0 }
    inside { sub(/[0-9.e+]+/, sprintf("%.1f", $1 * f)); print; next }
    /"(median|min|max)_ns": / { match($0, /: [0-9.e+]+/); v = substr($0, RSTART + 2, RLENGTH - 2); sub(/: [0-9.e+]+/, ": " sprintf("%.1f", v * f)) }
    { print }'
}
# steady_times: the k-th sample of every point becomes 1e6·(1 + k/100) ns, the median, min and
# max those of seven samples (for a sweep that takes exactly 7: --min-reps 7 --min-time 0), neither
# contended nor unstable, so doctored comparisons (and the dashboard exports, which leave such rows
# out) do not depend on this machine's noise.
steady_times() {
  awk '
    /"samples_ns": \[$/ { inside = 1; k = 0; print; next }
    inside && /\]/ { inside = 0 }
    inside { sub(/[0-9.e+]+/, sprintf("%.1f", 1e6 * (1 + k / 100))); k++; print; next }
    /"median_ns": / { sub(/: [0-9.e+]+/, ": 1030000.0") }
    /"min_ns": / { sub(/: [0-9.e+]+/, ": 1000000.0") }
    /"max_ns": / { sub(/: [0-9.e+]+/, ": 1060000.0") }
    /"contended": true/ { sub(/true/, "false") }
    /"unstable": true/ { sub(/true/, "false") }
    { print }'
}
# bump_first FIELD DELTA: adds DELTA to the first integer field FIELD.
bump_first() {
  awk -v field="\"$1\":" -v d="$2" '
    !done && index($0, field) { match($0, /: -?[0-9]+/); v = substr($0, RSTART + 2, RLENGTH - 2); sub(/: -?[0-9]+/, ": " (v + d)); done = 1 }
    { print }'
}
