#!/usr/bin/env bash
# Installs the Debian packages xfbench needs, only those missing (idempotent). Needs root or sudo.
set -euo pipefail
packages=(g++ cmake ninja-build git libdnnl-dev ocl-icd-opencl-dev libcli11-dev nlohmann-json3-dev
          libspdlog-dev doctest-dev libpugixml-dev python3 clang-format)
# The Slurm test (tests/cli/slurm_test.sh, docs/ci.md#shards-and-merge) runs a one-node cluster of its own.
if [ "${XFBENCH_SLURM_TEST:-}" = 1 ]; then packages+=(slurm-wlm munge); fi
packages+=(chromium)  # headless browser of tests/cli/html_report_test.sh (xfbench report's page)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install_deps: all ${#packages[@]} packages present"
  exit 0
fi
echo "install_deps: installing ${missing[*]}"
sudo_cmd=()
[ "$(id -u)" -ne 0 ] && sudo_cmd=(sudo)
"${sudo_cmd[@]}" apt-get update -qq
DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
