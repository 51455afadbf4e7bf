#!/usr/bin/env bash
# CI time gate: builds the base revision and the candidate (this work tree) in one job and runs
# `xfbench ab` between them, interleaved A B | B A per point, so both builds see the same machine
# and the same neighbours. Exit 0: no point slower; 1: a point slower (or a failed run); 2: bad input.
#
#   tools/ci_ab.sh BASE_REV [xfbench ab options…]
#   e.g. tools/ci_ab.sh origin/main --models implemented --seq-lens 512,1024 --format md
#
# Builds both with the release preset's flags but without -march=native (portable binaries), in
# build/ci-ab/{base,candidate}; the base from a detached `git worktree` of BASE_REV. Tracked
# memory and FLOPs stay gated by tools/ci_regression.sh.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
if [ $# -lt 1 ]; then
  echo "usage: tools/ci_ab.sh BASE_REV [xfbench ab options…]" >&2
  exit 2
fi
base_rev="$1"
shift
git -C "$root" rev-parse --verify --quiet "$base_rev^{commit}" >/dev/null || {
  echo "ci_ab.sh: unknown revision $base_rev" >&2
  exit 2
}
bash "$root/tools/install_deps.sh" >/dev/null
out="$root/build/ci-ab"
mkdir -p "$out"
worktree="$out/base-src"
git -C "$root" worktree remove --force "$worktree" >/dev/null 2>&1 || true
git -C "$root" worktree add --detach "$worktree" "$base_rev" >/dev/null
trap 'git -C "$root" worktree remove --force "$worktree" >/dev/null 2>&1 || true' EXIT
build() {  # SOURCE BUILD_DIR
  cmake -S "$1" -B "$2" -G Ninja -DCMAKE_BUILD_TYPE=Release -DXFBENCH_NATIVE=OFF -DXFBENCH_BUILD_TESTS=OFF >/dev/null
  cmake --build "$2" --target xfbench >/dev/null
}
build "$worktree" "$out/base"
build "$root" "$out/candidate"
"$out/candidate/xfbench" ab --a-bin "$out/base/xfbench" --b-bin "$out/candidate/xfbench" "$@"
