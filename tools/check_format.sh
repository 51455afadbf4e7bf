#!/usr/bin/env bash
# Fails (exit 1, naming each file) when a tracked C++ file differs from what clang-format makes of
# it with the tree's .clang-format; `--fix` rewrites them instead. Run by CTest (style.format).
#   tools/check_format.sh [--fix]
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v clang-format >/dev/null; then
  echo "check_format: clang-format is not installed (tools/install_deps.sh installs it)" >&2
  exit 1
fi
mapfile -t files < <(git ls-files '*.cpp' '*.hpp' 2>/dev/null || find apps lib taxonomy tests -name '*.[ch]pp')
if [ "${1:-}" = "--fix" ]; then
  clang-format -i "${files[@]}"
  exit 0
fi
offences=0
for file in "${files[@]}"; do
  if ! clang-format --dry-run -Werror "$file" >/dev/null 2>&1; then
    echo "$file: not formatted as .clang-format says (tools/check_format.sh --fix)" >&2
    offences=$((offences + 1))
  fi
done
[ "$offences" -eq 0 ] || exit 1
