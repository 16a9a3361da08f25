#!/usr/bin/env bash
# Two local users and one memory tier (issue 43): user A's tier files are unreadable to user B,
# and nothing B plants or redirects is taken for A's steps. Runs as root (as CI does) and drops
# to two unprivileged uids with setpriv; exits 77 (skipped) where it cannot.
#
#   tests/tier/two_users.sh TIER_USER_CHECK
set -u
check=${1:?usage: two_users.sh TIER_USER_CHECK}
if [ "$(id -u)" -ne 0 ] || ! command -v setpriv >/dev/null; then
  echo "SKIPPED: needs root and setpriv to act as two users"; exit 77
fi
A=23001 B=23002
work=$(mktemp -d /tmp/dcp-two-users.XXXXXX)
trap 'rm -rf "$work"' EXIT
chmod 0755 "$work"
# The program and dcp's libraries where both users can run them (the build tree may not be).
mkdir -p "$work/bin" "$work/lib"
cp "$check" "$work/bin/"
for lib in $(ldd "$check" | awk '/libdcp/ { print $3 }'); do cp "$lib" "$work/lib/"; done
chmod -R a+rX "$work/bin" "$work/lib"
as() {  # as UID CMD...: run CMD as that user (its own group, no other)
  local uid=$1; shift
  LD_LIBRARY_PATH="$work/lib" setpriv --reuid="$uid" --regid="$uid" --clear-groups "$@"
}
run() { as "$1" "$work/bin/$(basename "$check")" "${@:2}"; }
shm() { mkdir -p "$work/$1" && chmod 1777 "$work/$1" && echo "$work/$1"; }  # like /dev/shm

fail=0 reads=0 planted=0
expect() {  # expect WHAT PATTERN OUTPUT
  if [[ "$3" == *$2* ]]; then echo "ok: $1"; else echo "FAILED: $1: got '$3'"; fail=$((fail + 1)); fi
}

# 1. A saves; B can read nothing of it and plant nothing in it.
S=$(shm shared)
expect "A saves" "saved" "$(run $A save "$S")"
while IFS= read -r f; do
  if as $B cat "$f" >/dev/null 2>&1; then reads=$((reads + 1)); echo "B read $f"; fi
done < <(find "$S/dcp-tier-u$A" -type f)
as $B ls "$S/dcp-tier-u$A" >/dev/null 2>&1 && { echo "B listed A's tier"; reads=$((reads + 1)); }
for d in "$S/dcp-tier-u$A/default" "$S/dcp-tier-u$A/default/node-0"; do
  if as $B mkdir "$d/step-0000000099" 2>/dev/null; then planted=$((planted + 1)); fi
done
expect "B's own tier holds nothing of A's" "restored nothing" "$(run $B restore "$S")"
expect "A restores its newest step" "restored step 3" "$(run $A restore "$S")"

# 2. B creates A's tier directory before A (with a step of B's in it): A refuses it.
S=$(shm precreated)
run $B save "$S" >/dev/null
as $B mkdir -m 0700 "$S/dcp-tier-u$A"
as $B cp -a "$S/dcp-tier-u$B/default" "$S/dcp-tier-u$A/" 2>/dev/null
out=$(run $A restore "$S")
expect "A refuses a tier directory of B's" "belongs to uid $B" "$out"
[[ "$out" == "restored step"* ]] && planted=$((planted + 1))

# 3. B plants a link in the place of A's tier directory: A refuses it, never follows it.
S=$(shm linked)
run $B save "$S" >/dev/null
as $B ln -s "$S/dcp-tier-u$B" "$S/dcp-tier-u$A"
out=$(run $A restore "$S")
expect "A refuses a link" "symbolic link" "$out"
[[ "$out" == "restored step"* ]] && planted=$((planted + 1))

# 4. A's own tier left writable by all: whatever B put there is refused.
S=$(shm writable)
run $A save "$S" >/dev/null
chmod 0777 "$S/dcp-tier-u$A"
as $B mkdir "$S/dcp-tier-u$A/planted" 2>/dev/null
out=$(run $A restore "$S")
expect "A refuses a tier directory others may write" "writable by other users" "$out"
[[ "$out" == "restored step"* ]] && planted=$((planted + 1))

echo "two users: reads of another user's tier files $reads, planted or redirected steps accepted $planted, failures $fail"
((fail == 0 && reads == 0 && planted == 0))
