# The checks the command-line tests share, sourced by tests/cli/cli_reports_test.sh,
# tests/cli/cli_points_test.sh and tests/cli/ci_gate_test.sh. Expects $bin and $src; sets $work (a
# temporary folder, removed at exit), $out (the folder every output a command might create goes to:
# it must stay empty on a refusal) and $valid (a copy of the CI baseline, an input that must stay
# unchanged).
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
passes=0
failures=0
pass() { passes=$((passes + 1)); }
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

out="$work/out"  # every output a command might create goes here; it must stay empty on refusal
mkdir -p "$out"
valid="$work/valid.json"
cp "$src/results/ci-baseline.json" "$valid"

# digest FILE: its SHA-256 when it is a regular file (reading a FIFO would block), else its type.
digest() { if [ -f "$1" ]; then sha256sum "$1"; else stat -c %F "$1" 2>/dev/null || echo absent; fi; }

# error_lines FILE: stderr lines that are not the sanitizer build's "not optimised" warning.
error_lines() { grep -vc "this build is not optimised" "$1" || true; }

# expect_refusal CODE NEEDLE ARGS…: exit CODE, one stderr line containing NEEDLE, empty stdout,
# nothing created in $out, the valid input unchanged.
expect_refusal() {
  local code=$1 needle=$2
  shift 2
  local before
  before=$(sha256sum "$valid")
  timeout 20 "$bin" "$@" >"$work/stdout" 2>"$work/stderr"
  local got=$?
  if [ "$got" -ne "$code" ]; then
    fail "xfbench $* exited $got, want $code: $(head -c 300 "$work/stderr")"
  elif [ "$(error_lines "$work/stderr")" -ne 1 ]; then
    fail "xfbench $* printed $(error_lines "$work/stderr") stderr lines, want 1: $(head -c 600 "$work/stderr")"
  elif ! grep -qF -- "$needle" "$work/stderr"; then
    fail "xfbench $*: stderr does not name '$needle': $(cat "$work/stderr")"
  elif grep -qE "json\.exception|basic_filebuf|filesystem error|what\(\)" "$work/stderr"; then
    fail "xfbench $*: a library's internal text reached the user: $(cat "$work/stderr")"
  elif [ -s "$work/stdout" ]; then
    fail "xfbench $* printed to stdout on refusal"
  elif [ -n "$(ls -A "$out")" ]; then
    fail "xfbench $* created $(ls -A "$out")"
    rm -rf "${out:?}"/* "$out"/.[!.]*
  elif [ "$(sha256sum "$valid")" != "$before" ]; then
    fail "xfbench $* changed its input"
  else
    pass
  fi
}

