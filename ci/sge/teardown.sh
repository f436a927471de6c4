#!/usr/bin/env bash
# Stop what ci/sge/setup.sh started: delete the jobs in that cluster, then stop the sge_execd
# and sge_qmaster whose PIDs it recorded in $PCM_SGE_RUN/pids. Daemons it did not start are
# left running. Packages stay installed (setup.sh is fast the second time).
set -uo pipefail
run_dir=${PCM_SGE_RUN:-/run/dask-pcm-sge}
export SGE_ROOT=/var/lib/gridengine SGE_CELL=default
say() { echo "[ci/sge/teardown $(date +%T)] $*" >&2; }
[ -r "$run_dir/pids" ] || { say "nothing recorded in $run_dir/pids"; exit 0; }

is() { [ "$(ps -o stat=,comm= -p "$1" 2>/dev/null | awk '$1 !~ /^Z/ {print $2}')" = "$2" ]; }
qmaster=$(awk '$1 == "qmaster" {p = $2} END {print p}' "$run_dir/pids")
execd=$(awk '$1 == "execd" {p = $2} END {print p}' "$run_dir/pids")
if [ -n "$qmaster" ] && is "$qmaster" sge_qmaster && [ -n "$execd" ] && is "$execd" sge_execd; then
    if [ -n "$(qstat -u '*' 2>/dev/null)" ]; then
        say "deleting the jobs left in the cluster"
        qdel -u '*' >/dev/null 2>&1
        for _ in $(seq 40); do [ -z "$(qstat -u '*' 2>/dev/null)" ] && break; sleep 0.5; done
        [ -z "$(qstat -u '*' 2>/dev/null)" ] || qdel -f -u '*' >/dev/null 2>&1
    fi
fi
for pair in "$execd sge_execd" "$qmaster sge_qmaster"; do
    set -- $pair
    [ -n "${1:-}" ] && is "$1" "$2" || continue
    say "stopping $2 (pid $1)"
    kill -TERM "$1"
    for _ in $(seq 60); do is "$1" "$2" || break; sleep 0.5; done
    is "$1" "$2" && { say "$2 ignored SIGTERM for 30 s: SIGKILL"; kill -KILL "$1"; }
done
rm -f "$run_dir/pids"
