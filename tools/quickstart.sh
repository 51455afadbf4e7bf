#!/usr/bin/env bash
# One command from a fresh Debian 12 machine to a first report: installs what is missing, builds
# the release preset, runs the default sweep, prints its table and writes
# results/default-sweep.json and results/default-sweep.md.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install_deps.sh
cmake --preset release >/dev/null
cmake --build --preset release
build/release/xfbench sweep --out results/default-sweep.json "$@"
build/release/xfbench table results/default-sweep.json --format md >results/default-sweep.md
build/release/xfbench table results/default-sweep.json --metric speedup --format md >>results/default-sweep.md
build/release/xfbench table results/default-sweep.json --metric memory --format md >>results/default-sweep.md
build/release/xfbench table results/default-sweep.json --metric gflops --format md >>results/default-sweep.md
