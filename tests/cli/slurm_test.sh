#!/usr/bin/env bash
# The cluster recipe of docs/ci.md on a real one-node Slurm: starts munged, slurmctld and slurmd
# of its own (a generated slurm.conf, keys, state, spool and logs in a temporary folder, free
# ports), submits tools/slurm_sweep.sh as the documented job array of a small sharded sweep, merges
# the shards with `xfbench merge` and checks that the merged report equals a single-process sweep
# of the same points in everything but time. Stops every daemon and job it started and removes its
# folder on exit.
#   tests/cli/slurm_test.sh XFBENCH
# XFBENCH_SLURM_TEST: 0 skips; 1 (CI) requires the test to run, so that Slurm missing or failing to
# start fails; unset runs it where Slurm can start and skips otherwise. Exit 0: pass; 1: fail;
# 77: skipped (CTest's SKIP_RETURN_CODE).
set -uo pipefail
bin=$(realpath "$1")
src="$(cd "$(dirname "$0")/../.." && pwd)"
mode=${XFBENCH_SLURM_TEST:-}

# unavailable REASON…: Slurm cannot run here: a skip, or a failure when the test is required.
unavailable() {
  echo "$*"
  if [ "$mode" = 1 ]; then
    echo "FAIL: XFBENCH_SLURM_TEST=1 requires the Slurm test to run"
    exit 1
  fi
  echo "SKIP: the Slurm test needs root and Debian's slurm-wlm and munge (XFBENCH_SLURM_TEST=1 tools/install_deps.sh)"
  exit 77
}

[ "$mode" = 0 ] && { echo "SKIP: XFBENCH_SLURM_TEST=0"; exit 77; }
[ "$(id -u)" -eq 0 ] || unavailable "not root: the daemons run as SlurmUser=root"
for command in mungekey munged slurmctld slurmd sbatch squeue scancel sinfo python3; do
  command -v "$command" >/dev/null || unavailable "$command not found"
done

work=$(mktemp -d)
chmod 755 "$work"  # munged needs every folder above its socket searchable
conf="$work/slurm.conf"
daemons=()  # munged, slurmctld and slurmd
job=""

# environment_pids: the processes that run with this test's SLURM_CONF (daemons, step daemons, job
# tasks and sbatch all inherit it), found by their environment so that nothing else is touched.
# Builtins only: a command started here would carry the variable itself.
environment_pids() {
  local proc entry
  for proc in /proc/[0-9]*; do
    while IFS= read -r -d '' entry; do
      [ "$entry" = "SLURM_CONF=$conf" ] && echo "${proc#/proc/}" && break
    done 2>/dev/null <"$proc/environ"
  done 2>/dev/null
}

# wait_until SECONDS COMMAND…: polls COMMAND every half second until it succeeds, for SECONDS at most.
wait_until() {
  local end=$((SECONDS + $1))
  shift
  until "$@" >/dev/null 2>&1; do
    [ "$SECONDS" -lt "$end" ] || return 1
    sleep 0.5
  done
}

# Slurm's clients retry an absent controller for long: each call is bounded.
queue_empty() { [ -z "$(timeout 3 squeue -h -j "$job" 2>/dev/null)" ]; }
daemons_gone() { ! kill -0 "${daemons[@]}" 2>/dev/null; }  # kill -0 succeeds while any is alive

# stop_all: cancels the job, shuts the daemons down (killing whatever outlives a grace period)
# and removes the folder.
stop_all() {
  if [ -n "$job" ]; then
    timeout 3 scancel "$job" 2>/dev/null
    wait_until 10 queue_empty
  fi
  # SIGTERM is each daemon's orderly shutdown.
  kill "${daemons[@]}" 2>/dev/null
  wait_until 10 daemons_gone
  # shellcheck disable=SC2046
  kill -KILL "${daemons[@]}" $(environment_pids) 2>/dev/null
  wait 2>/dev/null
  rm -rf "$work"
}
trap stop_all EXIT
trap 'exit 1' INT TERM

# logs_tail: the end of every daemon log, for a failure's diagnosis.
logs_tail() { for log in "$work"/log/*; do echo "--- $log"; tail -n 15 "$log"; done; }

# --- the cluster -----------------------------------------------------------------------------
# Slurm's commands and daemons read $SLURM_CONF; the variables of an enclosing Slurm job would
# confuse sbatch.
unset "${!SLURM_@}"
export SLURM_CONF="$conf"
mkdir -p "$work"/{munge,munge-socket,ctld,spool,log,jobs}
chmod 700 "$work/munge"
socket="$work/munge-socket/munge.socket"
mungekey -c -k "$work/munge/munge.key" || unavailable "mungekey failed"
munged -F --key-file="$work/munge/munge.key" --socket="$socket" --pid-file="$work/munge/munged.pid" \
  --seed-file="$work/munge/munged.seed" --log-file="$work/log/munged.log" >/dev/null 2>&1 &
daemons+=($!)
wait_until 10 test -S "$socket" || { logs_tail; unavailable "munged did not start"; }

read -r ctld_port slurmd_port < <(python3 -c '
import socket
s = [socket.socket() for _ in range(2)]
for x in s: x.bind(("127.0.0.1", 0))
print(*(x.getsockname()[1] for x in s))')
host=$(uname -n)
cat >"$conf" <<EOF
ClusterName=xfbench-test
SlurmctldHost=${host%%.*}(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$socket
StateSaveLocation=$work/ctld
SlurmdSpoolDir=$work/spool
SlurmctldPidFile=$work/ctld/slurmctld.pid
SlurmdPidFile=$work/spool/slurmd.pid
SlurmctldLogFile=$work/log/slurmctld.log
SlurmdLogFile=$work/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
NodeName=localhost NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=test Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
slurmctld -D >"$work/log/slurmctld.stderr" 2>&1 &
daemons+=($!)
slurmd -D -N localhost >"$work/log/slurmd.stderr" 2>&1 &
daemons+=($!)
node_idle() { [ "$(timeout 3 sinfo -h -n localhost -o %T)" = idle ]; }
wait_until 20 node_idle || { logs_tail; unavailable "slurmctld and slurmd did not bring the node up"; }

# --- the recipe --------------------------------------------------------------------------------
passes=0
failures=0
pass() { passes=$((passes + 1)); }
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

# The test runs the doc's commands: the script it submits and the merge.
for line in "sbatch --wait --array=1-8 tools/slurm_sweep.sh" "xfbench merge sweep-*.json -o sweep.json"; do
  grep -qF -- "$line" "$src/docs/ci.md" && pass || fail "docs/ci.md no longer says '$line'"
done

sweep=(--models "vanilla,local,performer" --seq-lens "64,128" --heads 2 --head-dim 16 --threads 2 --seed 42
  --warmup 1 --min-reps 1 --min-time 0 --no-measure --no-table)
cd "$work/jobs" || exit 1
XFBENCH="$bin" timeout 90 sbatch --wait --array=1-3 "$src/tools/slurm_sweep.sh" "${sweep[@]}" >sbatch.out 2>&1 &
submitter=$!
wait_until 10 grep -q "Submitted batch job" sbatch.out
job=$(grep -o "[0-9]*$" sbatch.out)
timeout 90 "$bin" -q sweep "${sweep[@]}" --out "$work/single.json" 2>"$work/single.err" ||
  fail "the single-process sweep failed: $(tail -3 "$work/single.err")"
if wait "$submitter"; then
  job=""
  pass
else
  fail "the job array did not finish cleanly: $(cat sbatch.out; timeout 3 squeue; tail -n 5 slurm-*.out; logs_tail)"
fi
"$bin" merge sweep-*.json -o sweep.json 2>merge.err || fail "xfbench merge: $(cat merge.err)"

[ -f sweep.json ] && python3 - sweep.json "$work/single.json" sweep-*.json <<'PY' && pass || fail "the merged report differs from the single-process sweep"
import json, sys

merged, single = (json.load(open(name)) for name in sys.argv[1:3])
shards = [json.load(open(name)) for name in sys.argv[3:]]

# What depends on time or on the run rather than on the points: timings and their statistics,
# contention, the process's resident memory, when and how the report was made.
TIMING = {"cv", "unstable", "contended", "contended_samples", "cpu_ratio", "host_busy", "load_average",
          "peak_rss_bytes"}
RUN = {"date", "command_line", "merged_from"}

def timeless(row):
    kept = {key: value for key, value in row.items()
            if key not in TIMING and not key.endswith(("_ns", "_per_s"))}
    kept["warnings"] = [w for w in row.get("warnings", []) if not w.startswith("contended:")]
    return kept

def context(report):
    return {key: value for key, value in report["context"].items() if key not in RUN}

assert len(shards) == 3 and all(s["results"] for s in shards), "every shard ran a point"
assert sorted(s["settings"]["shard"] for s in shards) == ["1/3", "2/3", "3/3"], [s["settings"] for s in shards]
assert [m["shard"] for m in merged["context"]["merged_from"]] == ["1/3", "2/3", "3/3"]
assert len(single["results"]) == 6 and all(r["status"] == "ok" for r in single["results"])
for key in ("schema_version", "tool", "settings"):
    assert merged[key] == single[key], (key, merged[key], single[key])
assert context(merged) == context(single), (context(merged), context(single))
for got, want in zip(merged["results"], single["results"], strict=True):
    assert got.keys() == want.keys(), (got.keys(), want.keys())
    assert timeless(got) == timeless(want), {k: (v, timeless(want).get(k)) for k, v in timeless(got).items()
                                              if v != timeless(want).get(k)}
PY

echo "$passes passed, $failures failed"
[ "$failures" -eq 0 ]
