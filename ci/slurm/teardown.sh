#!/usr/bin/env bash
# Stop what ci/slurm/setup.sh started: cancel the jobs in that cluster, then stop the slurmd,
# slurmctld and munged whose PIDs it recorded in $PCM_SLURM_RUN/pids. Daemons it did not
# start are left running. Packages and slurm.conf stay (setup.sh is fast the second time).
set -uo pipefail
run_dir=${PCM_SLURM_RUN:-/run/dask-pcm-slurm}
say() { echo "[ci/slurm/teardown $(date +%T)] $*" >&2; }
[ -r "$run_dir/pids" ] || { say "nothing recorded in $run_dir/pids"; exit 0; }

is() { [ "$(ps -o stat=,comm= -p "$1" 2>/dev/null | awk '$1 !~ /^Z/ {print $2}')" = "$2" ]; }
pid_of() { awk -v w="$1" '$1 == w {p = $2} END {print p}' "$run_dir/pids"; }
ctld=$(pid_of slurmctld)
slurmd=$(pid_of slurmd)
munged=$(pid_of munged)
if [ -n "$ctld" ] && is "$ctld" slurmctld && [ -n "$slurmd" ] && is "$slurmd" slurmd; then
    jobs=$(squeue -h -o %i 2>/dev/null)
    if [ -n "$jobs" ]; then
        say "cancelling the jobs left in the cluster"
        scancel $jobs 2>/dev/null
        for _ in $(seq 80); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.25; done
        [ -z "$(squeue -h -o %i 2>/dev/null)" ] || scancel --signal=KILL --full $jobs 2>/dev/null
    fi
    # squeue forgets a cancelled job before its slurmstepd has stopped the job's processes.
    for _ in $(seq 60); do [ -z "$(ps -C slurmstepd -o pid= 2>/dev/null)" ] && break; sleep 0.25; done
fi
for pair in "$slurmd slurmd" "$ctld slurmctld" "$munged munged"; do
    set -- $pair
    [ -n "${1:-}" ] && is "$1" "$2" || continue
    say "stopping $2 (pid $1)"
    kill -TERM "$1"
    for _ in $(seq 60); do is "$1" "$2" || break; sleep 0.25; done
    is "$1" "$2" && { say "$2 ignored SIGTERM for 15 s: SIGKILL"; kill -KILL "$1"; }
done
# slurmctld leaves its pid file behind; Debian's prerm would then run scancel against nothing.
for f in /run/slurmctld.pid /run/slurmd.pid; do
    [ -r "$f" ] && ! is "$(cat "$f")" "$(basename "$f" .pid)" && rm -f "$f"
done
rm -f "$run_dir/pids"
