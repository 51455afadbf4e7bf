#!/usr/bin/env bash
# Fails (exit 1, one line per offence) when a project include goes against the layers:
#   lib/core      includes only lib/core
#   taxonomy      includes lib/core and taxonomy
#   lib/report    includes lib/core, lib/report and taxonomy/cards.hpp (model cards, never kernels)
#   lib/bench     includes lib/core, lib/report, lib/bench, taxonomy and the generated git_commit.hpp
# Run by the build (CMakeLists.txt) before the libraries compile.  tools/check_layers.sh [ROOT]
set -euo pipefail
root="${1:-$(cd "$(dirname "$0")/.." && pwd)}"
cd "$root"
allowed() {  # allowed FILE INCLUDE
  case "$1" in
    lib/core/*) [[ "$2" == lib/core/* ]] ;;
    taxonomy/*) [[ "$2" == lib/core/* || "$2" == taxonomy/* ]] ;;
    lib/report/*) [[ "$2" == lib/core/* || "$2" == lib/report/* || "$2" == taxonomy/cards.hpp ]] ;;
    lib/bench/*) [[ "$2" == lib/core/* || "$2" == lib/report/* || "$2" == lib/bench/* || "$2" == taxonomy/* ||
                    "$2" == git_commit.hpp ]] ;;
    *) return 0 ;;
  esac
}
offences=0
while IFS= read -r file; do
  while IFS=: read -r line include; do
    if ! allowed "$file" "$include"; then
      echo "$file:$line: includes \"$include\" against the layers (tools/check_layers.sh)" >&2
      offences=$((offences + 1))
    fi
  done < <(grep -n '^#include "' "$file" | sed -E 's/^([0-9]+):#include "([^"]+)".*/\1:\2/')
done < <(find lib taxonomy -type f \( -name '*.hpp' -o -name '*.cpp' -o -name '*.inc' \) | sort)
[ "$offences" -eq 0 ] || exit 1
