#!/usr/bin/env bash
# Run a command that must fail fast: exit non-zero within MAX_SECONDS, its output (stdout and
# stderr) matching PATTERN (an extended regular expression).
#   expect_fast_failure.sh MAX_SECONDS PATTERN COMMAND [ARGS...]
# A command still running after MAX_SECONDS + 30 s is killed and reported as a hang.
set -u
max=$1 pattern=$2
shift 2
start=$(date +%s.%N)
out=$(timeout -k 5 $((max + 30)) "$@" 2>&1)
rc=$?
end=$(date +%s.%N)
secs=$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.1f", b - a }')
printf '%s\n' "$out"
echo "expect_fast_failure: exit code $rc after $secs s (limit $max s)"
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
  echo "FAILED: still running after $((max + 30)) s (a hang)"
  exit 1
fi
if [ "$rc" -eq 0 ]; then
  echo "FAILED: exit code 0, expected non-zero"
  exit 1
fi
if ! awk -v s="$secs" -v m="$max" 'BEGIN { exit !(s <= m) }'; then
  echo "FAILED: took $secs s, more than $max s"
  exit 1
fi
if ! printf '%s\n' "$out" | grep -Eq -- "$pattern"; then
  echo "FAILED: the output does not match: $pattern"
  exit 1
fi
echo "ok"
