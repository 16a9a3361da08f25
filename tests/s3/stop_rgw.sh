#!/usr/bin/env bash
# Stop the cluster tests/s3/start_rgw.sh started under DIR and remove DIR (with --keep: leave
# DIR, e.g. to read its logs). Only the daemons whose pid files are under DIR are signalled.
set -uo pipefail

dir=${1:?usage: stop_rgw.sh DIR [--keep]}
[ -d "$dir" ] || exit 0
pids=()
for f in "$dir"/run/*.pid; do
  [ -f "$f" ] || continue
  pid=$(cat "$f" 2>/dev/null)
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && pids+=("$pid")
done
# radosgw first (clients), then the OSD, then the monitor; all get TERM, then KILL after 10 s.
[ ${#pids[@]} -gt 0 ] && kill -TERM "${pids[@]}" 2>/dev/null
for _ in $(seq 20); do
  alive=()
  for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive+=("$p"); done
  [ ${#alive[@]} -eq 0 ] && break
  sleep 0.5
done
for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && kill -KILL "$p" 2>/dev/null; done
[ "${2:-}" = --keep ] || rm -rf "$dir"
exit 0
