#!/usr/bin/env bash
# Fails (exit 1, one line per offence) when a project include goes against the layers, which the
# folders read bottom-up (lib, then taxonomy, then apps; in apps report, bench, cli):
#   lib/core      includes only lib/core
#   taxonomy      includes lib/core and taxonomy
#   apps/report   includes lib/core, apps/report and taxonomy/cards.hpp (model cards, never kernels)
#   apps/bench    includes lib/core, taxonomy, apps/report, apps/bench and the generated git_commit.hpp
#   apps/cli      includes any of them
# Run by the build (CMakeLists.txt) before the libraries compile.  cmake/check_layers.sh [ROOT]
set -euo pipefail
root="${1:-$(cd "$(dirname "$0")/.." && pwd)}"
cd "$root"
allowed() {  # allowed FILE INCLUDE
  case "$1" in
    lib/core/*) [[ "$2" == lib/core/* ]] ;;
    taxonomy/*) [[ "$2" == lib/core/* || "$2" == taxonomy/* ]] ;;
    apps/report/*) [[ "$2" == lib/core/* || "$2" == apps/report/* || "$2" == taxonomy/cards.hpp ]] ;;
    apps/bench/*) [[ "$2" == lib/core/* || "$2" == apps/report/* || "$2" == apps/bench/* || "$2" == taxonomy/* ||
                    "$2" == git_commit.hpp ]] ;;
    *) return 0 ;;
  esac
}
offences=0
while IFS= read -r file; do
  while IFS=: read -r line include; do
    if ! allowed "$file" "$include"; then
      echo "$file:$line: includes \"$include\" against the layers (cmake/check_layers.sh)" >&2
      offences=$((offences + 1))
    fi
  done < <(grep -n '^#include "' "$file" | sed -E 's/^([0-9]+):#include "([^"]+)".*/\1:\2/')
done < <(find lib taxonomy apps -type f \( -name '*.hpp' -o -name '*.cpp' -o -name '*.inc' \) | sort)
[ "$offences" -eq 0 ] || exit 1
