#!/usr/bin/env bash
# SIGKILL trials for the memory tier (issue 26). Each trial starts a 4-rank job of dcp-tier-train
# (2 simulated nodes; every step to memory, every 3rd also to a durable root, in the background)
# that resumes from where the last trial left off, kills it at a random moment (during a save's
# write, its replication, its commit, a drain, retention or the restore itself), sometimes all of
# its ranks at once and sometimes wiping a node's shared memory too, then restarts it with
# --verify: the step it restores must hold exactly that step's values (no mixed or torn step),
# and it must never be older than the newest durable step, which must never go backwards.
#
#   tools/tier_crash_trials.sh BUILD_DIR [TRIALS=200] [WORK_DIR]
# Exit status 0 when every trial passed; prints a summary line.
set -u
build=${1:?usage: tier_crash_trials.sh BUILD_DIR [TRIALS] [WORK_DIR]}
trials=${2:-200}
work=${3:-$(mktemp -d /tmp/dcp-tier-trials.XXXXXX)}
train="$build/tools/dcp-tier-train"
name="trials-$$"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
args=(--dir "$work/durable" --name "$name" --ranks-per-node 2 --durable-every 3 --mib 2)
mkdir -p "$work"
# The job's tier: <shm>/dcp-tier-u<uid>/<name>-<hash of the durable root> (dcp/memory_tier.h).
tier_glob="/dev/shm/dcp-tier-u$(id -u)/$name-"
trap 'rm -rf "$tier_glob"*' EXIT

fail=0 memory=0 durable=0 nowhere=0 wiped=0 wiped_all=0 all_killed=0 last_durable=-1
for ((t = 1; t <= trials; ++t)); do
  mpirun -np 4 "$train" "${args[@]}" --resume --steps 100000000 >"$work/run.log" 2>&1 &
  job=$!
  sleep "$(awk -v s="$RANDOM" 'BEGIN { srand(s); printf "%.3f", 0.3 + 2.2 * rand() }')"
  # A loaded machine starts the ranks late: wait for them (up to 30 s), never for the job, which
  # trains until it is killed.
  for ((i = 0; i < 300; ++i)); do
    ranks=($(pgrep -P "$job" -f dcp-tier-train))
    ((${#ranks[@]} > 0)) || ! kill -0 "$job" 2>/dev/null && break
    sleep 0.1
  done
  if ((${#ranks[@]} == 0)); then
    if kill -0 "$job" 2>/dev/null; then
      echo "trial $t: no rank of the job started in 30 s:"
    else
      echo "trial $t: the job ended before the kill:"
    fi
    tail -5 "$work/run.log"; fail=$((fail + 1))
    pkill -9 -P "$job" 2>/dev/null; kill -9 "$job" 2>/dev/null; wait "$job" 2>/dev/null; continue
  fi
  if ((RANDOM % 4 == 0)); then
    kill -9 "${ranks[@]}" 2>/dev/null; all_killed=$((all_killed + 1))
  else
    kill -9 "${ranks[RANDOM % ${#ranks[@]}]}" 2>/dev/null
  fi
  # mpirun outlives its killed ranks by up to a minute when they die in its start-up; with
  # every rank gone there is nothing left for it to report, so it goes too.
  timeout 10 tail --pid="$job" -f /dev/null || kill -9 "$job" 2>/dev/null
  wait "$job" 2>/dev/null
  r=$((RANDOM % 12))
  if ((r < 4)); then  # the node's memory goes with it
    rm -rf "$tier_glob"*/"node-$((RANDOM % 2))"; wiped=$((wiped + 1))
  elif ((r == 4)); then  # every node's: the restart must fall back to the durable root
    rm -rf "$tier_glob"*; wiped_all=$((wiped_all + 1))
  fi
  out=$(timeout 120 mpirun -np 4 "$train" "${args[@]}" --verify 2>&1)
  rc=$?
  line=$(grep -m1 "^verify: restored" <<<"$out")
  d=$(sed -n 's/.*durable newest \(-\?[0-9]*\).*/\1/p' <<<"$line")
  if ((rc != 0)) || [[ -z "$line" || "$line" != *bit-exact* ]] || ((${d:--2} < last_durable)); then
    echo "trial $t FAILED (rc $rc, durable newest ${d:-?} after $last_durable):"
    echo "$out" | tail -8
    fail=$((fail + 1))
  fi
  [[ -n "${VERBOSE:-}" ]] && echo "trial $t: $line" && grep "fell back" <<<"$out"
  [[ -n "$d" ]] && ((d > last_durable)) && last_durable=$d
  case "$line" in
    *"from memory"*) memory=$((memory + 1)) ;;
    *"from durable"*) durable=$((durable + 1)) ;;
    *) nowhere=$((nowhere + 1)) ;;
  esac
done
echo "tier crash trials: $trials trials ($all_killed killing every rank, $wiped wiping a node's" \
  "memory, $wiped_all every node's): restored from memory $memory, from durable $durable, nothing yet $nowhere;" \
  "newest durable step $last_durable; failures $fail"
((fail == 0))
