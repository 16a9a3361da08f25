#!/usr/bin/env bash
# The resume demo as a check: train 12 steps at 4 ranks uninterrupted; train again at 4 ranks but
# stop after step 6 (checkpoints every 3 steps), resume at 2 ranks (resharded) to step 12, and
# require the resumed losses to equal the uninterrupted run's bit for bit.
#   train_resume_check.sh DCP_TRAIN MPIEXEC WORKDIR
set -euo pipefail
train=$1 mpiexec=$2 work=$3
rm -rf "$work" && mkdir -p "$work"
run() { local np=$1; shift; "$mpiexec" --oversubscribe -np "$np" "$train" "$@"; }
run 4 --dir "$work/reference" --steps 12 --every 3 --losses "$work/reference.txt"
run 4 --dir "$work/job" --steps 12 --every 3 --stop-after 6
run 2 --dir "$work/job" --steps 12 --every 3 --resume --compare "$work/reference.txt"
