#!/usr/bin/env bash
# The whole test suite: installs what is missing, builds the dev preset (warnings are errors) and
# runs every test with CTest. Pass --preset asan for the sanitizer build.
set -euo pipefail
cd "$(dirname "$0")/.."
preset=dev
if [ "${1:-}" = "--preset" ]; then preset="$2"; fi
bash tools/install_deps.sh
cmake --preset "$preset" >/dev/null
cmake --build --preset "$preset"
ctest --preset "$preset" -j 2
