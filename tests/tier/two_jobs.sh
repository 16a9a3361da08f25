#!/usr/bin/env bash
# Two jobs on one node with the default tier name (issue 43): two 2-rank dcp-tier-train jobs save
# 40 and 45 steps at once, each to its own durable root; then a job is killed mid-run and a new
# job starts on an empty root. No job may free or restore another's steps: each restores its own
# newest step from memory, bit-exact, and the new job restores nothing.
#
#   tests/tier/two_jobs.sh MPIEXEC DCP_TIER_TRAIN
set -u
mpiexec=${1:?usage: two_jobs.sh MPIEXEC DCP_TIER_TRAIN} train=${2:?}
work=$(mktemp -d /tmp/dcp-two-jobs.XXXXXX)
trap 'rm -rf "$work"' EXIT
shm="$work/shm"
mkdir -p "$shm" && chmod 1777 "$shm"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
job() {  # job ROOT ARGS...: a 2-rank job, 2 simulated nodes, the default tier name
  local root=$1; shift
  "$mpiexec" --oversubscribe -np 2 "$train" --dir "$work/$root" --shm-root "$shm" --name default \
    --ranks-per-node 1 --durable-every 10 --mib 1 "$@"
}
fail=0
expect() {  # expect WHAT PATTERN OUTPUT
  if [[ "$3" == *$2* ]]; then echo "ok: $1"; else echo "FAILED: $1: got: $3"; fail=$((fail + 1)); fi
}
# The tier steps a job's directory holds (found by its JOB record), per node.
steps_of() {
  local d
  for d in "$shm"/dcp-tier-u*/default-*; do
    if grep -q "$work/$1\$" "$d/JOB" 2>/dev/null; then
      (cd "$d" && ls -d node-*/step-* 2>/dev/null | sed 's/step-0*//' | tr '\n' ' ')
    fi
  done
}

job a --steps 40 >"$work/a.log" 2>&1 &
pa=$!
job b --steps 45 >"$work/b.log" 2>&1 &
pb=$!
wait $pa; ra=$?
wait $pb; rb=$?
((ra == 0)) || { echo "FAILED: job a exited $ra"; tail -5 "$work/a.log"; fail=$((fail + 1)); }
((rb == 0)) || { echo "FAILED: job b exited $rb"; tail -5 "$work/b.log"; fail=$((fail + 1)); }
expect "job a's tier keeps its own newest steps" "node-0/39 node-0/40 node-1/39 node-1/40 " "$(steps_of a)"
expect "job b's tier keeps its own newest steps" "node-0/44 node-0/45 node-1/44 node-1/45 " "$(steps_of b)"
expect "job a restores its own step 40" "restored step 40 from memory" "$(job a --verify 2>&1)"
expect "job b restores its own step 45" "restored step 45 from memory" "$(job b --verify 2>&1)"
expect "restores are bit-exact" "bit-exact" "$(job a --verify 2>&1)"

# A job killed mid-run, then a new job on an empty root with the same tier name.
job c --steps 100000000 --step-ms 20 >"$work/c.log" 2>&1 &
pc=$!
sleep 4
pkill -9 -P "$pc" -f dcp-tier-train; kill -9 "$pc" 2>/dev/null; wait "$pc" 2>/dev/null
out=$(job new-job --verify 2>&1)
expect "a new job on an empty root restores nothing" "restored step -1 from nowhere" "$out"
out=$(job c --verify 2>&1)
expect "the crashed job restores its own newest step from memory" "from memory" "$out"
expect "... bit-exact" "bit-exact" "$out"
expect "jobs a and b still hold their steps" "node-0/39 node-0/40 node-1/39 node-1/40 " "$(steps_of a)"
echo "two jobs: failures $fail"
((fail == 0))
