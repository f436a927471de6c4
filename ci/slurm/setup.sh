#!/usr/bin/env bash
# Install and start a single-host SLURM (Debian's slurmctld, slurmd, slurm-client and munge,
# SLURM 22.05) on this machine, for dask_pcm's `slurm` tests and for trying dask_pcm on SLURM
# locally. Runs as root, without systemd. Idempotent: what is installed, configured or
# running already is left as it is. The PIDs of the daemons this script starts go to
# $PCM_SLURM_RUN/pids, so that ci/slurm/teardown.sh stops those and nothing else.
#
#   sudo bash ci/slurm/setup.sh            # then: sinfo; squeue
#
# One node (this host), one partition (PCM_SLURM_PARTITION, debug) where up to
# PCM_SLURM_SHARE (4) one-core jobs share each CPU. What the configuration changes from
# SLURM's defaults, and why:
# - no cgroups (proctrack/linuxproc, task/none): they fail in containers and small VMs;
# - CR_CPU: memory is checked at submit but not reserved (a job without --mem would
#   otherwise hold the whole node);
# - scheduling every 1-2 s (backfill and main), not every 60 s: jobs start in under a second;
# - cred_expire 10 s: a requeued job is held that long before it may start again (120 s);
# - preempt_send_user_signal: a job preempted or cancelled gets its --signal warning first.
set -euo pipefail

partition=${PCM_SLURM_PARTITION:-debug}
share=${PCM_SLURM_SHARE:-4}
run_dir=${PCM_SLURM_RUN:-/run/dask-pcm-slurm}
conf=/etc/slurm/slurm.conf
mark="# written by dask_pcm ci/slurm/setup.sh"
packages="munge slurmctld slurmd slurm-client"
started=$(date +%s%N)

say() { echo "[ci/slurm/setup $(date +%T)] $*" >&2; }
fail() { echo "[ci/slurm/setup] error: $*" >&2; exit 1; }
[ "$(id -u)" -eq 0 ] || fail "run as root (it installs Debian packages and starts daemons)"
mkdir -p "$run_dir"
host=$(hostname -s)
[ -n "$host" ] || fail "this machine has no hostname"
if ! getent hosts "$host" >/dev/null; then
    say "$host does not resolve: adding it to /etc/hosts"
    echo "127.0.1.1 $host  # dask_pcm ci/slurm/setup.sh" >>/etc/hosts
fi

# 1. Packages; a temporary policy-rc.d keeps the maintainer scripts from starting daemons.
if [ "$(dpkg-query -W -f='${Status}\n' $packages 2>/dev/null | grep -c 'ok installed')" != 4 ]; then
    say "installing $packages"
    policy=""
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        policy=/usr/sbin/policy-rc.d
        printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy"
        trap 'rm -f "$policy"' EXIT
    fi
    [ "${PCM_SLURM_SKIP_APT_UPDATE:-0}" = 1 ] || apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $packages >/dev/null
    [ -z "$policy" ] || rm -f "$policy"
fi

# A PID from a pid file, if that process is alive (not a zombie) and is the named daemon.
alive_pid() { # name pidfile
    local p
    [ -r "$2" ] || return 0
    p=$(cat "$2")
    [ "$(ps -o stat=,comm= -p "$p" 2>/dev/null | awk '$1 !~ /^Z/ {print $2}')" = "$1" ] && echo "$p"
    return 0
}
munged_pid() { alive_pid munged /run/munge/munged.pid; }
slurmctld_pid() { alive_pid slurmctld /run/slurmctld.pid; }
slurmd_pid() { alive_pid slurmd /run/slurmd.pid; }

# 2. munge: a key, and munged running as its own user.
if [ ! -s /etc/munge/munge.key ]; then
    install -d -o munge -g munge -m 0700 /etc/munge
    mungekey --create --keyfile=/etc/munge/munge.key
fi
chown munge:munge /etc/munge/munge.key && chmod 0600 /etc/munge/munge.key
if [ -z "$(munged_pid)" ] && ! (munge -n 2>/dev/null | unmunge >/dev/null 2>&1); then
    say "starting munged"
    install -d -o munge -g munge -m 0755 /run/munge
    runuser -u munge -- /usr/sbin/munged --force
    for _ in $(seq 40); do [ -n "$(munged_pid)" ] && break; sleep 0.25; done
    [ -n "$(munged_pid)" ] || fail "munged did not start; see /var/log/munge/munged.log"
    echo "munged $(munged_pid)" >>"$run_dir/pids"
fi
munge -n | unmunge >/dev/null || fail "munge does not work; see /var/log/munge/munged.log"

# 3. slurm.conf, written only when it differs (and never over one this script did not write).
memory=$(free -m | awk '/^Mem:/ {print $2}')
new=$(mktemp)
trap 'rm -f "$new"' EXIT
cat >"$new" <<CONF
$mark: a one-host test cluster; run the script again rather than editing.
ClusterName=pcm
SlurmctldHost=$host(127.0.0.1)
SlurmUser=slurm
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire=10
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0,sched_interval=2,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmctldParameters=preempt_send_user_signal
SlurmdParameters=config_overrides
EnforcePartLimits=ALL
ReturnToService=2
MessageTimeout=5
KillWait=10
MinJobAge=120
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
StateSaveLocation=/var/lib/slurm/slurmctld
SlurmdSpoolDir=/var/lib/slurm/slurmd
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
NodeName=$host NodeAddr=127.0.0.1 CPUs=$(nproc) RealMemory=$memory State=UNKNOWN
PartitionName=$partition Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:$share
CONF
if ! cmp -s "$new" "$conf"; then
    if [ -e "$conf" ] && ! head -1 "$conf" | grep -q "^$mark"; then
        fail "$conf exists and was not written by this script; move it aside first"
    fi
    [ -z "$(slurmctld_pid)$(slurmd_pid)" ] \
        || fail "slurm.conf must change but SLURM is running: run ci/slurm/teardown.sh first"
    say "writing $conf (node $host, $(nproc) CPUs, partition $partition)"
    install -m 0644 "$new" "$conf"
fi
install -d -o slurm -g slurm /var/lib/slurm /var/lib/slurm/slurmctld /var/log/slurm
install -d /var/lib/slurm/slurmd

# 4. The daemons. slurmctld starts clean (-c): no job of an earlier run comes back.
if [ -z "$(slurmctld_pid)" ]; then
    say "starting slurmctld"
    /usr/sbin/slurmctld -c
    for _ in $(seq 60); do scontrol ping 2>/dev/null | grep -q 'is UP' && break; sleep 0.25; done
    [ -n "$(slurmctld_pid)" ] || fail "slurmctld did not start; see /var/log/slurm/slurmctld.log"
    echo "slurmctld $(slurmctld_pid)" >>"$run_dir/pids"
fi
if [ -z "$(slurmd_pid)" ]; then
    say "starting slurmd"
    /usr/sbin/slurmd
    for _ in $(seq 40); do [ -n "$(slurmd_pid)" ] && break; sleep 0.25; done
    [ -n "$(slurmd_pid)" ] || fail "slurmd did not start; see /var/log/slurm/slurmd.log"
    echo "slurmd $(slurmd_pid)" >>"$run_dir/pids"
fi
state() { sinfo -h -N -n "$host" -o %T 2>/dev/null | head -1; }
for _ in $(seq 120); do
    case "$(state)" in
        idle | mixed | allocated | completing) break ;;
        down* | drain* | fail*) scontrol update NodeName="$host" State=RESUME 2>/dev/null || true ;;
    esac
    sleep 0.25
done
case "$(state)" in
    idle | mixed | allocated | completing) ;;
    *) fail "node $host is '$(state)': $(scontrol show node "$host" | grep -o 'Reason=.*')" ;;
esac
say "ready in $((($(date +%s%N) - started) / 1000000)) ms: partition $partition on $host"
