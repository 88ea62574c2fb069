#!/usr/bin/env bash
# A throwaway single-node Ceph cluster serving S3 on 127.0.0.1, for tests and benchmarks.
#
#   tools/rgw_server.sh start DIR   # prints "endpoint=http://127.0.0.1:PORT" when it answers
#   tools/rgw_server.sh stop DIR    # stops the daemons by their pid files; DIR stays
#   tools/rgw_server.sh status DIR  # exit 0 while radosgw answers
#   tools/rgw_server.sh kill-rgw DIR   # SIGKILL radosgw only (a server crash; the data stays)
#   tools/rgw_server.sh start-rgw DIR  # start radosgw again on the same port and wait for it
#
# One monitor, one OSD on memstore (objects live in the OSD's memory, so nothing touches
# the disk and a stop loses everything), one radosgw, all bound to 127.0.0.1 on free
# ports, with their config, data, logs, sockets and pid files under DIR. Authentication
# inside the cluster is off (it never leaves loopback); S3 requests are signed as usual
# with a user that has fixed keys:
#   RGW_ACCESS_KEY (default tieredkvtest), RGW_SECRET_KEY (default tieredkvtestsecret).
# RGW_MEMSTORE_BYTES bounds the OSD's memory (default 2 GiB); RGW_START_TIMEOUT is how
# long start waits for radosgw to answer (default 90 s). With RGW_OWNER_PID set, a
# watcher stops the cluster once that process is gone (a test run killed before its
# clean-up leaves no daemons behind).
# Needs the Debian packages ceph-mon ceph-osd radosgw ceph-common (`make rgw`).
set -euo pipefail

cmd=${1:-}
dir=${2:-}
if [[ -z $cmd || -z $dir ]]; then
  echo "usage: $0 start|stop|status|kill-rgw|start-rgw DIR" >&2
  exit 2
fi
access_key=${RGW_ACCESS_KEY:-tieredkvtest}
secret_key=${RGW_SECRET_KEY:-tieredkvtestsecret}
memstore_bytes=${RGW_MEMSTORE_BYTES:-2147483648}
start_timeout=${RGW_START_TIMEOUT:-90}

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

answers() {  # radosgw answers HTTP on its port
  local port
  port=$(cat "$dir/rgw.port" 2>/dev/null) || return 1
  python3 - "$port" <<'EOF'
import sys, urllib.request, urllib.error
try:
    urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/", timeout=2)
except urllib.error.HTTPError:
    pass  # any HTTP answer counts
except OSError:
    sys.exit(1)
EOF
}

stop_daemon() {  # NAME [SIGNAL]: by its pid file; SIGKILL after 5 s
  local pid pidfile="$dir/run/$1.pid"
  [[ -f $pidfile ]] || return 0
  pid=$(cat "$pidfile")
  if kill -0 "$pid" 2>/dev/null; then
    kill "-${2:-KILL}" "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$pidfile"
}

stop() {
  # radosgw first, the monitor last: each daemon leaves cleanly while the others still run.
  local name
  for name in client.rgw.x osd.0 mon.a; do stop_daemon "$name"; done
}

wait_answers() {
  local deadline=$((SECONDS + start_timeout))
  until answers; do
    if ((SECONDS >= deadline)); then
      echo "rgw_server: radosgw did not answer on 127.0.0.1:$(cat "$dir/rgw.port") within ${start_timeout}s;" \
        "logs in $dir/log" >&2
      return 1
    fi
    sleep 0.3
  done
}

case $cmd in
stop)
  stop
  exit 0
  ;;
status)
  answers
  exit $?
  ;;
kill-rgw)
  stop_daemon client.rgw.x KILL
  exit 0
  ;;
watch)  # internal: watch OWNER_PID ($3) and stop the cluster when it is gone
  while [[ -f $dir/run/mon.a.pid ]] && kill -0 "${3:?}" 2>/dev/null; do sleep 2; done
  stop
  exit 0
  ;;
start-rgw)
  radosgw -c "$dir/ceph.conf" -n client.rgw.x 2>>"$dir/log/daemons.err"
  wait_answers
  exit $?
  ;;
start) ;;
*)
  echo "usage: $0 start|stop|status|kill-rgw|start-rgw DIR (got $cmd)" >&2
  exit 2
  ;;
esac

for tool in monmaptool ceph-mon ceph-osd radosgw radosgw-admin ceph; do
  if ! command -v "$tool" >/dev/null; then
    echo "rgw_server: $tool not found; install the Debian packages ceph-mon ceph-osd radosgw ceph-common (make rgw)" >&2
    exit 3
  fi
done

mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
if [[ -e $dir/ceph.conf ]]; then
  stop
  rm -rf "${dir:?}/mon" "${dir:?}/osd" "${dir:?}/run" "${dir:?}/log" "$dir/ceph.conf" "$dir/monmap" "$dir/rgw.port"
fi
mkdir -p "$dir/mon" "$dir/osd" "$dir/run" "$dir/log" "$dir/rgw"
chmod 700 "$dir"

fsid=$(python3 -c 'import uuid; print(uuid.uuid4())')
mon_v2=$(free_port)
mon_v1=$(free_port)
rgw_port=$(free_port)
conf=$dir/ceph.conf
cat >"$conf" <<EOF
[global]
fsid = $fsid
mon host = [v2:127.0.0.1:$mon_v2,v1:127.0.0.1:$mon_v1]
public addr = 127.0.0.1
auth cluster required = none
auth service required = none
auth client required = none
ms mon client mode = crc
run dir = $dir/run
pid file = $dir/run/\$name.pid
admin socket = $dir/run/\$name.asok
log file = $dir/log/\$name.log
keyring = $dir/keyring
mon data = $dir/mon/\$name
osd data = $dir/osd/\$name
osd objectstore = memstore
memstore device bytes = $memstore_bytes
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
osd crush chooseleaf type = 0
mon allow pool size one = true
mon allow pool delete = true
mon max pg per osd = 1000
mon warn on pool no redundancy = false
# The monitor refuses to start (and stops) below 5% free space on the file system of its
# data; a test cluster's monitor data is a few MB, on a disk that other tenants may fill.
mon data avail crit = 0
mon data avail warn = 0
osd memory target = 939524096
rgw frontends = beast endpoint=127.0.0.1:$rgw_port
rgw data = $dir/rgw
EOF
echo "$rgw_port" >"$dir/rgw.port"

ceph_q() { timeout 30 ceph -c "$conf" "$@"; }
failed() {  # the failing command's status and the daemons' error lines, so a CI log says why
  local status=$?
  echo "rgw_server: start failed (exit status $status); logs in $dir/log" >&2
  sleep 0.5 # a daemon that exits at once may still be writing its log
  { grep -h -e ' -1 ' "$dir"/log/*.log; cat "$dir/log/daemons.err"; } 2>/dev/null | grep . | tail -n 6 >&2 || true
  stop
}
trap failed ERR

monmaptool --create --fsid "$fsid" --addv a "[v2:127.0.0.1:$mon_v2,v1:127.0.0.1:$mon_v1]" "$dir/monmap" >/dev/null
ceph-mon -c "$conf" -i a --mkfs --monmap "$dir/monmap" >"$dir/log/mkfs-mon.out" 2>&1
ceph-mon -c "$conf" -i a 2>>"$dir/log/daemons.err"
osd_uuid=$(python3 -c 'import uuid; print(uuid.uuid4())')
osd_id=$(ceph_q osd new "$osd_uuid")
mkdir -p "$dir/osd/osd.$osd_id"
ceph-osd -c "$conf" -i "$osd_id" --mkfs --osd-uuid "$osd_uuid" >"$dir/log/mkfs-osd.out" 2>&1
ceph-osd -c "$conf" -i "$osd_id" 2>>"$dir/log/daemons.err"
radosgw -c "$conf" -n client.rgw.x 2>>"$dir/log/daemons.err"

wait_answers
timeout 60 radosgw-admin -c "$conf" -n client.rgw.x user create --uid=tieredkv --display-name=tieredkv \
  --access-key="$access_key" --secret-key="$secret_key" >"$dir/log/user.out" 2>&1
trap - ERR
if [[ -n ${RGW_OWNER_PID:-} ]]; then
  setsid bash "$0" watch "$dir" "$RGW_OWNER_PID" </dev/null >/dev/null 2>&1 &
fi
echo "endpoint=http://127.0.0.1:$rgw_port"
