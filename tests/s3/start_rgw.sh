#!/usr/bin/env bash
# Start a single-node Ceph cluster with a RADOS Gateway on loopback, for the s3:// tests.
#
#   tests/s3/start_rgw.sh DIR      start it with its state under DIR (created; must be empty)
#   tests/s3/stop_rgw.sh DIR       stop every daemon this started and remove DIR
#
# One monitor, one OSD on the in-memory object store (memstore: nothing on disk but the logs
# and the monitor's small database), one radosgw (beast) on 127.0.0.1, one S3 user. No
# cephadm, no systemd, no root needed beyond being able to run the daemons. Ports are free
# ones picked at start, so two runs on one machine do not collide.
#
# On success prints, on stdout, the environment a test needs (shell `export` lines):
#   DCP_TEST_S3_ENDPOINT, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION
# and exits 0. On failure (a missing binary, a daemon that does not come up within its time
# bound) prints the reason on stderr, stops whatever it started, and exits non-zero; the
# callers then skip the tests that need the server, printing the reason. Every step has a time
# bound; the whole start takes well under two minutes (typically ~15-30 s).
set -euo pipefail

dir=${1:?usage: start_rgw.sh DIR}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
log() { printf '[start_rgw] %s\n' "$*" >&2; }
fail() {
  log "FAILED: $*"
  for f in "$dir"/*.log; do
    [ -f "$f" ] && { log "--- tail of $f"; tail -n 15 "$f" >&2 || true; }
  done
  "$here/stop_rgw.sh" "$dir" --keep >/dev/null 2>&1 || true
  exit 1
}

for tool in ceph-mon ceph-osd radosgw radosgw-admin monmaptool ceph uuidgen python3 curl; do
  command -v "$tool" >/dev/null 2>&1 || {
    log "missing '$tool' (Debian 12: apt-get install radosgw ceph-mon ceph-osd ceph-common uuid-runtime curl)"
    exit 1
  }
done

mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
[ -z "$(ls -A "$dir")" ] || { log "$dir is not empty"; exit 1; }
mkdir -p "$dir/mon" "$dir/osd" "$dir/rgw" "$dir/run"

# Three free loopback ports (monitor msgr1, radosgw); bind to 0 and read the port back.
read -r mon_port rgw_port < <(python3 - <<'EOF'
import socket
ss = [socket.socket() for _ in range(2)]
for s in ss: s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in ss))
EOF
)

fsid=$(uuidgen)
access_key="DCPTEST$(od -An -N6 -tx1 /dev/urandom | tr -d ' \n' | tr a-f A-F)"
secret_key="$(od -An -N20 -tx1 /dev/urandom | tr -d ' \n')"
conf="$dir/ceph.conf"
# auth none: a throwaway cluster on loopback; S3 requests are still signed and checked by the
# gateway (its own user keys), which is what the client under test exercises.
cat >"$conf" <<EOF
[global]
fsid = $fsid
mon host = v1:127.0.0.1:$mon_port
mon initial members = a
ms bind msgr2 = false
ms bind ipv6 = false
public addr = 127.0.0.1
auth cluster required = none
auth service required = none
auth client required = none
auth allow insecure global id reclaim = true
run dir = $dir/run
admin socket = $dir/run/\$name.asok
pid file = $dir/run/\$name.pid
log file = $dir/\$name.log
keyring = /dev/null
osd pool default size = 1
osd pool default min size = 1
mon allow pool size one = true
mon warn on pool no redundancy = false
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
mon max pg per osd = 1000
osd crush chooseleaf type = 0
mon data avail warn = 1
mon data avail crit = 0
mon osd full ratio = .99
mon osd nearfull ratio = .99
mon osd backfillfull ratio = .99
osd failsafe full ratio = .99
debug ms = 0

[mon]
mon data = $dir/mon/\$cluster-\$id
mon allow pool delete = true

[osd]
osd data = $dir/osd/\$cluster-\$id
osd objectstore = memstore
memstore device bytes = 4294967296
memstore page set = false
osd memory target = 1073741824
osd op num shards = 1
osd op num threads per shard = 2
osd class load list = *
osd class default list = *
# The OSD's own crush updates at start are refused with auth none (its first monitor command
# carries no fsid yet): the OSD is placed in the crush map from the command line instead.
osd crush update on start = false
osd class update on start = false

[client.rgw.a]
rgw data = $dir/rgw
rgw frontends = beast endpoint=127.0.0.1:$rgw_port
rgw dns name = localhost
rgw thread pool size = 64
rgw enable usage log = false
# Deleted and overwritten objects' data goes to RGW's garbage collector, which by default frees it
# two hours later: a few dcp-s3-bench runs (GiBs each) would fill the 4 GiB memstore and every
# write would then hang. Collect within seconds instead.
rgw gc obj min wait = 0
rgw gc processor period = 5
rgw gc processor max time = 5
rgw max chunk size = 4194304
rgw obj stripe size = 4194304
rgw put obj min window size = 16777216
rgw get obj min window size = 16777216
rgw init timeout = 60
EOF

# --fsid as well: Debian 12's ceph 16.2.15 CLI reconnects after reading the configuration with
# a monmap of fsid 0, which the monitor refuses (EPERM "wrong fsid") unless given explicitly.
c=(-c "$conf" --fsid "$fsid")
t() { timeout "$@"; }

log "monitor on 127.0.0.1:$mon_port, state in $dir"
t 30 monmaptool --create --clobber --fsid "$fsid" --addv a "[v1:127.0.0.1:$mon_port]" \
  "$dir/monmap" >/dev/null 2>&1 || fail "monmaptool"
t 30 ceph-mon "${c[@]}" --mkfs -i a --monmap "$dir/monmap" >>"$dir/setup.log" 2>&1 ||
  fail "ceph-mon --mkfs"
t 30 ceph-mon "${c[@]}" -i a >>"$dir/setup.log" 2>&1 || fail "ceph-mon start"
t 45 ceph "${c[@]}" --connect-timeout 40 status >/dev/null 2>&1 || fail "monitor not answering"

log "osd (memstore)"
osd_uuid=$(uuidgen)
osd_id=$(t 30 ceph "${c[@]}" osd new "$osd_uuid" 2>>"$dir/setup.log") || fail "ceph osd new"
mkdir -p "$dir/osd/ceph-$osd_id"
t 60 ceph-osd "${c[@]}" -i "$osd_id" --mkfs --osd-uuid "$osd_uuid" >>"$dir/setup.log" 2>&1 ||
  fail "ceph-osd --mkfs"
t 30 ceph "${c[@]}" osd crush add "osd.$osd_id" 1.0 host=localhost root=default \
  >>"$dir/setup.log" 2>&1 || fail "ceph osd crush add"
t 30 ceph-osd "${c[@]}" -i "$osd_id" >>"$dir/setup.log" 2>&1 || fail "ceph-osd start"
for _ in $(seq 60); do
  up=$(t 10 ceph "${c[@]}" osd stat -f json 2>/dev/null |
    python3 -c 'import json,sys; print(json.load(sys.stdin).get("num_up_osds",0))' 2>/dev/null || echo 0)
  [ "$up" = 1 ] && break
  sleep 1
done
[ "$up" = 1 ] || fail "osd did not come up in 60 s"

log "radosgw on 127.0.0.1:$rgw_port"
t 30 radosgw "${c[@]}" -n client.rgw.a >>"$dir/setup.log" 2>&1 || fail "radosgw start"
for _ in $(seq 90); do
  code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 2 "http://127.0.0.1:$rgw_port/" || true)
  [ "$code" = 200 ] && break
  rgw_pid=$(cat "$dir/run/client.rgw.a.pid" 2>/dev/null || true)
  [ -n "$rgw_pid" ] && ! kill -0 "$rgw_pid" 2>/dev/null && fail "radosgw exited"
  sleep 1
done
[ "$code" = 200 ] || fail "radosgw not answering on port $rgw_port in 90 s (last HTTP code '$code')"

t 60 radosgw-admin "${c[@]}" -n client.rgw.a user create --uid dcp-test --display-name "dcp tests" \
  --access-key "$access_key" --secret "$secret_key" >>"$dir/setup.log" 2>&1 ||
  fail "radosgw-admin user create"

# Warm up: a fresh gateway creates its pools on the first bucket and the first object, which takes
# seconds (2.9 s and 2.0 s here). A test's first request would otherwise be that slow, and a test
# lock with a 2 s lease would be expired the moment its create returned.
s3curl() {
  curl -sS -f --max-time 60 --aws-sigv4 "aws:amz:us-east-1:s3" --user "$access_key:$secret_key" \
    -H "x-amz-content-sha256: UNSIGNED-PAYLOAD" -o /dev/null "$@"
}
s3curl -X PUT "http://127.0.0.1:$rgw_port/dcp-warmup" &&
  s3curl -X PUT --data-binary warm "http://127.0.0.1:$rgw_port/dcp-warmup/object" &&
  s3curl -X DELETE "http://127.0.0.1:$rgw_port/dcp-warmup/object" ||
  fail "the first bucket and object could not be written"

cat >"$dir/env.sh" <<EOF
export DCP_TEST_S3_ENDPOINT=http://127.0.0.1:$rgw_port
export AWS_ENDPOINT_URL=http://127.0.0.1:$rgw_port
export AWS_ACCESS_KEY_ID=$access_key
export AWS_SECRET_ACCESS_KEY=$secret_key
export AWS_REGION=us-east-1
EOF
log "ready: S3 endpoint http://127.0.0.1:$rgw_port"
cat "$dir/env.sh"
