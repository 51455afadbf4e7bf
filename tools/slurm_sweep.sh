#!/bin/bash
# One shard of a sweep per task of a Slurm job array (docs/ci.md#shards-and-merge). The array is
# the shard numbers, 1-based and contiguous; the arguments are the sweep's options:
#
#   sbatch --wait --array=1-8 tools/slurm_sweep.sh --models all --seq-lens 256:16384:x2 \
#     --threads 2 --memory-limit 16
#   xfbench merge sweep-*.json -o sweep.json
#
# Task i runs `xfbench sweep OPTIONS --shard i/N --out sweep-i.json` in the submission directory
# (or sbatch's --chdir). XFBENCH names the binary (default: xfbench on PATH); sbatch passes the
# environment on. Keep --cpus-per-task equal to the sweep's --threads (override it on the sbatch
# command line, which wins over the line below); --exclusive keeps other jobs off the node while a
# shard is timed.
#SBATCH --cpus-per-task=2 --exclusive
set -euo pipefail
task=${SLURM_ARRAY_TASK_ID:-}
if [ -z "$task" ] || [ "${SLURM_ARRAY_TASK_MIN:-}" != 1 ] || [ "${SLURM_ARRAY_TASK_STEP:-1}" != 1 ] ||
  [ "${SLURM_ARRAY_TASK_MAX:-}" != "${SLURM_ARRAY_TASK_COUNT:-}" ]; then
  echo "slurm_sweep.sh: submit it as a job array of shard numbers: sbatch --array=1-N $0 [sweep options]" >&2
  exit 2
fi
exec "${XFBENCH:-xfbench}" sweep "$@" --shard "$task/$SLURM_ARRAY_TASK_COUNT" --out "sweep-$task.json"
