#!/usr/bin/env bash
# The CI regression gate (tools/ci_regression.sh) against the committed baseline, and against
# doctored baselines it must fail on. The gate runs in full twice: with oneDNN held to AVX2, the
# baseline's ISA (owned bytes, scratchpad and FLOPs all compared), and unrestricted (on an AVX-512
# host the scratchpad differs and only the project's own bytes and FLOPs are compared). The doctored
# baselines are checked against those two runs' kept reports (--new), not five more sweeps.
#   tests/cli/ci_gate_test.sh XFBENCH
set -u
bin="$1"
src="$(cd "$(dirname "$0")/../.." && pwd)"
source "$src/tests/cli/common.sh"
source "$src/tests/cli/doctor.sh"

gate="$src/tools/ci_regression.sh"
baseline="$src/results/ci-baseline.json"
ONEDNN_MAX_CPU_ISA=AVX2 bash "$gate" --keep "$work/avx2.json" "$bin" "$baseline" >"$work/gate.md" 2>&1 \
  && pass || fail "CI gate (AVX2) fails on the committed baseline: $(cat "$work/gate.md")"
bash "$gate" --keep "$work/native.json" "$bin" "$baseline" >"$work/gate.md" 2>&1 \
  && pass || fail "CI gate fails on the committed baseline: $(cat "$work/gate.md")"
[ -s "$work/avx2.json" ] && [ -s "$work/native.json" ] && pass || fail "--keep kept no report"

# expect_regression WHAT NEW DOCTORED: the gate given NEW's report exits 1 naming WHAT.
expect_regression() {
  bash "$gate" --new "$2" "$bin" "$3" >"$work/gate.md" 2>&1
  local got=$?
  [ "$got" -eq 1 ] && grep -q "REGRESSION: $1" "$work/gate.md" && pass \
    || fail "CI gate (--new $(basename "$2")) exited $got without REGRESSION: $1 against $(basename "$3")"
}
# A baseline one byte smaller (so the new run grew by one byte) and one with other FLOPs must fail:
# owned bytes on any host, the total (scratchpad included) where oneDNN runs the baseline's ISA.
bump_first peak_owned_bytes -1 <"$baseline" >"$work/doctored-memory.json"
expect_regression memory "$work/native.json" "$work/doctored-memory.json"
bump_first peak_tensor_bytes -1 <"$baseline" >"$work/doctored-total.json"
expect_regression memory "$work/avx2.json" "$work/doctored-total.json"
bump_first flops 100 <"$baseline" >"$work/doctored-flops.json"
expect_regression flops "$work/native.json" "$work/doctored-flops.json"
# A baseline point with other parameters (a changed default) is missing from the new sweep: fail.
bump_first block_q 1 <"$baseline" >"$work/doctored-params.json"
expect_regression missing "$work/native.json" "$work/doctored-params.json"
# The undoctored baseline against the kept report passes (the failures above are the doctoring's),
# and a doctored report given with --new fails: it is the report compared.
bash "$gate" --new "$work/native.json" "$bin" "$baseline" >/dev/null 2>&1 && pass || fail "CI gate --new fails undoctored"
bump_first flops 100 <"$work/native.json" >"$work/grown.json"
expect_regression flops "$work/grown.json" "$baseline"
# Bad use of the gate: exit 2.
bash "$gate" --new >/dev/null 2>&1
[ $? -eq 2 ] && pass || fail "CI gate: --new without a file is not exit 2"
bash "$gate" --new "$work/nosuch.json" "$bin" "$baseline" >/dev/null 2>&1
[ $? -eq 2 ] && pass || fail "CI gate: a missing --new report is not exit 2"

echo "$passes passed, $failures failed"
[ "$failures" -eq 0 ]
