#!/usr/bin/env bash
# Preemption trials for CheckpointManager::HandlePreemption (issue 48). Each trial starts a
# 4-rank job of dcp-tier-train (2 simulated nodes; every step to memory, every 3rd also to the
# durable root, in the background) that resumes from where the last trial left off. It sends
# every rank SIGTERM at a random moment (in its restore, a save's write, replication or commit,
# a drain, retention, or between saves; in half of the trials after the restore), and SIGKILL
# after the grace window to whatever still runs, as a scheduler does. In half of the trials the
# nodes' shared memory goes with the job (preempted machines), so the restart can only find what
# was drained to the root. One trial in four is a crash instead (SIGKILL only, memory kept): the
# next job restores a step only memory holds, and its preemption must drain that step. The
# restart (--verify) must restore exactly the step the handler reported drained (or found
# durable), bit-exact; when the handler reported nothing complete in memory (or no report: the
# notice came in MPI's start-up), the step the trial before restored; after a crash, the newest
# step memory holds, never older than before. A handler that reports nothing while memory holds
# the step to restore (a notice before the job's restore) fails the trial when the memory goes.
#
#   tools/tier_sigterm_trials.sh BUILD_DIR [TRIALS=200] [WORK_DIR] [DURABLE_ROOT] [GRACE_S=5]
# DURABLE_ROOT: any dcp location (default WORK_DIR/durable, emptied first; a fresh
# s3://bucket/prefix for the RGW).
# Exit status 0 when every trial passed; prints a summary line with the drain times.
set -u
build=${1:?usage: tier_sigterm_trials.sh BUILD_DIR [TRIALS] [WORK_DIR] [DURABLE_ROOT] [GRACE_S]}
trials=${2:-200}
work=${3:-$(mktemp -d /tmp/dcp-sigterm-trials.XXXXXX)}
durable=${4:-$work/durable}
grace=${5:-5}
train="$build/tools/dcp-tier-train"
name="sigterm-$$"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
args=(--dir "$durable" --name "$name" --ranks-per-node 2 --durable-every 3 --mib 2)
mkdir -p "$work"
# Trial 1 expects an empty root (nothing to restore): a local one left by an earlier run is
# removed; an s3:// DURABLE_ROOT must be a fresh prefix.
[[ "$durable" == *://* ]] || rm -rf "$durable"
tier_glob="/dev/shm/dcp-tier-u$(id -u)/$name-"
trap 'rm -rf "$tier_glob"*' EXIT

fail=0 drained=0 durable_already=0 nothing=0 unreported_total=0 wiped=0 crashes=0 expected=-1 expected_durable=1
times=()
for ((t = 1; t <= trials; ++t)); do
  mpirun -np 4 "$train" "${args[@]}" --resume --steps 100000000 --preempt-grace "$grace" \
    >"$work/run.log" 2>&1 &
  job=$!
  # Half of the notices come at any moment from the start (MPI's start-up, the restore); the
  # others once the job trains (its restore printed), which a slow start (a sanitizer) would
  # otherwise rarely reach.
  if ((RANDOM % 2 == 0)); then
    for ((i = 0; i < 300; ++i)); do
      grep -q "^resume: restored" "$work/run.log" 2>/dev/null || ! kill -0 "$job" 2>/dev/null &&
        break
      sleep 0.1
    done
  fi
  sleep "$(awk -v s="$RANDOM" 'BEGIN { srand(s); printf "%.3f", 0.05 + 2 * rand() }')"
  # Every rank gets the notice, as from a scheduler: wait for all 4 (a loaded machine starts
  # them late).
  for ((i = 0; i < 100; ++i)); do
    ranks=($(pgrep -P "$job" -f dcp-tier-train))
    ((${#ranks[@]} == 4)) || ! kill -0 "$job" 2>/dev/null && break
    sleep 0.1
  done
  if ((${#ranks[@]} != 4)); then
    echo "trial $t: the job's 4 ranks were not found (${#ranks[@]}):"; tail -5 "$work/run.log"
    fail=$((fail + 1)); kill -9 "${ranks[@]}" "$job" 2>/dev/null; wait "$job"; continue
  fi
  # One trial in four is a crash instead (SIGKILL, no notice, the memory kept): the next job
  # restores a step that only memory holds, which its own preemption must then drain.
  crash=$((RANDOM % 4 == 0))
  if ((crash)); then
    kill -9 "${ranks[@]}" 2>/dev/null
  else
    kill -TERM "${ranks[@]}" 2>/dev/null
    # The grace window, then SIGKILL to what is left.
    timeout "$grace" tail --pid="$job" -f /dev/null
    kill -9 "${ranks[@]}" 2>/dev/null
  fi
  # mpirun outlives its killed ranks by up to a minute when they die in its start-up; with
  # every rank gone there is nothing left for it to report, so it goes too.
  timeout 10 tail --pid="$job" -f /dev/null || kill -9 "$job" 2>/dev/null
  wait "$job" 2>/dev/null
  report=$(grep -m1 "^preempt: \(step\|nothing\|FAILED\)" "$work/run.log")
  ((crash)) && report="crash" && crashes=$((crashes + 1))
  unreported=0
  case "$report" in
    crash) ;;
    *drained*|*"already durable"*)
      expected=$(sed -n 's/^preempt: step \([0-9]*\).*/\1/p' <<<"$report")
      expected_durable=1
      if [[ "$report" == *drained* ]]; then
        drained=$((drained + 1))
        times+=("$(sed -n 's/.* in \([0-9.]*\) s (.*/\1/p' <<<"$report")")
      else
        durable_already=$((durable_already + 1))
      fi ;;
    *nothing*) nothing=$((nothing + 1)) ;;
    *FAILED*)
      echo "trial $t FAILED: $report"; tail -5 "$work/run.log"; fail=$((fail + 1)) ;;
    *)
      # No report: SIGTERM came before the handler was installed (during MPI's start-up), which
      # ends the job before it committed anything. (A drain that went unreported would show
      # at the restart: it restores a step other than the one expected.)
      unreported=1 ;;
  esac
  # The preempted machines' memory is gone, in half of the trials: not after a crash, nor when
  # no handler ran while the step to restore may be in memory only (restored after a crash, and
  # the notice came in MPI's start-up, before the handler was installed).
  if ((!crash && (!unreported || expected_durable) && RANDOM % 2 == 0)); then
    rm -rf "$tier_glob"*; wiped=$((wiped + 1))
  fi
  out=$(timeout 120 mpirun -np 4 "$train" "${args[@]}" --verify 2>&1)
  rc=$?
  line=$(grep -m1 "^verify: restored" <<<"$out")
  got=$(sed -n 's/^verify: restored step \(-\?[0-9]*\).*/\1/p' <<<"$line")
  # After a crash: whatever memory holds newest, never older than what was durable.
  ((crash)) && [[ -n "$got" ]] && ((got >= expected)) && expected=$got && expected_durable=0
  if ((rc != 0)) || [[ "$line" != *bit-exact* ]] || [[ "${got:-x}" != "$expected" ]]; then
    echo "trial $t FAILED (rc $rc): expected step $expected, got '${got:-?}': $report"
    echo "$out" | tail -6
    fail=$((fail + 1))
  fi
  [[ -n "${VERBOSE:-}" ]] && echo "trial $t: ${report:-no report} | $line"
  unreported_total=$((unreported_total + unreported))
  [[ -n "$got" ]] && expected=$got
done
median=$(printf '%s\n' "${times[@]:-}" | sort -n | awk 'NF { a[n++] = $1 } END { if (n) print a[int((n - 1) / 2)]; else print "-" }')
echo "tier sigterm trials: $trials trials ($crashes crashes, $wiped wiping every node's memory): drained $drained" \
  "(median $median s), already durable $durable_already, nothing in memory $nothing," \
  "no report (a notice in MPI's start-up) $unreported_total;" \
  "failures $fail"
((fail == 0))
