#!/usr/bin/env bash
# Install and start a single-host Son of Grid Engine (Debian's gridengine 8.1.9 packages) on
# this machine, for dask_pcm's `sge` tests and for trying dask_pcm on a batch system locally.
# Runs as root, without systemd. Idempotent: what is installed, configured or running already
# is left as it is. The PIDs of the daemons this script starts go to $PCM_SGE_RUN/pids, so
# that ci/sge/teardown.sh stops those and nothing else.
#
#   sudo bash ci/sge/setup.sh            # then: qstat -f
#
# Settings (environment): PCM_SGE_QUEUE (all.q), PCM_SGE_SLOTS (4), PCM_SGE_NOTIFY (seconds
# between the notify signal and the kill of a `qsub -notify` job on qdel; 15),
# PCM_SGE_RUN (/run/dask-pcm-sge), PCM_SGE_SKIP_APT_UPDATE=1.
set -euo pipefail

queue=${PCM_SGE_QUEUE:-all.q}
slots=${PCM_SGE_SLOTS:-4}
notify=${PCM_SGE_NOTIFY:-15}
run_dir=${PCM_SGE_RUN:-/run/dask-pcm-sge}
export SGE_ROOT=/var/lib/gridengine SGE_CELL=default
common=$SGE_ROOT/$SGE_CELL/common
spool=/var/spool/gridengine
packages="gridengine-master gridengine-exec gridengine-client"
started=$(date +%s)

say() { echo "[ci/sge/setup $(date +%T)] $*" >&2; }
fail() { echo "[ci/sge/setup] error: $*" >&2; exit 1; }
[ "$(id -u)" -eq 0 ] || fail "run as root (it installs Debian packages and starts daemons)"
mkdir -p "$run_dir"
host=$(hostname)
[ -n "$host" ] || fail "this machine has no hostname"

# SGE refuses to run on a host whose own name does not resolve.
if ! getent hosts "$host" >/dev/null; then
    say "$host does not resolve: adding it to /etc/hosts"
    echo "127.0.1.1 $host  # dask_pcm ci/sge/setup.sh" >>/etc/hosts
fi

# 1. Packages. debconf answers make the postinst create the cell; a temporary policy-rc.d
#    keeps the maintainer scripts from starting daemons before they are configured.
if [ "$(dpkg-query -W -f='${Status}\n' $packages 2>/dev/null | grep -c 'ok installed')" != 3 ]; then
    say "installing $packages"
    for p in gridengine-common gridengine-client gridengine-master gridengine-exec; do
        printf '%s\n' "$p shared/gridengineconfig boolean true" \
            "$p shared/gridenginecell string $SGE_CELL" \
            "$p shared/gridenginemaster string $host" | debconf-set-selections
    done
    policy=""
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        policy=/usr/sbin/policy-rc.d
        printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy"
        trap 'rm -f "$policy"' EXIT
    fi
    [ "${PCM_SGE_SKIP_APT_UPDATE:-0}" = 1 ] || apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $packages >/dev/null
    [ -z "$policy" ] || rm -f "$policy"
fi
if [ ! -s "$common/bootstrap" ] || [ -z "$(ls -A "$spool/spooldb" 2>/dev/null)" ]; then
    say "creating cell $SGE_CELL"
    install -d -o sgeadmin -g sgeadmin "$SGE_ROOT/$SGE_CELL" "$common" "$spool/qmaster" \
        "$spool/qmaster/job_scripts" "$spool/spooldb" "$spool/execd"
    install -m 0644 -o sgeadmin -g sgeadmin /usr/share/gridengine/default-bootstrap "$common/bootstrap"
    su -s /bin/sh -c "/usr/share/gridengine/scripts/init_cluster $SGE_ROOT $SGE_CELL $spool/spooldb sgeadmin" sgeadmin
fi

# A PID from a pid file, if that process is alive (not a zombie) and is the named daemon.
alive_pid() { # name pidfile...
    local name=$1 f p
    shift
    for f in "$@"; do
        [ -r "$f" ] || continue
        p=$(cat "$f")
        [ "$(ps -o stat=,comm= -p "$p" 2>/dev/null | awk '$1 !~ /^Z/ {print $2}')" = "$name" ] && { echo "$p"; return 0; }
    done
    return 0
}
qmaster_pid() { alive_pid sge_qmaster "$spool/qmaster/qmaster.pid"; }
execd_pid() { alive_pid sge_execd /run/gridengine/execd.pid "$spool"/execd/*/execd.pid; }

# 2. Host names, while the qmaster is down: it must be this host, and the name the loopback
#    address resolves to ("localhost") must count as this host, or SGE denies every client.
if [ -z "$(qmaster_pid)" ]; then
    echo "$host" >"$common/act_qmaster"
    ip=$(getent ahostsv4 "$host" | awk 'NR == 1 {print $1}')
    reverse=$(getent hosts "$ip" | awk '{print $2}')
    if [ -n "$reverse" ] && [ "$reverse" != "$host" ]; then
        echo "$host $reverse" >"$common/host_aliases"
    else
        rm -f "$common/host_aliases"
    fi
    chown sgeadmin:sgeadmin "$common"/act_qmaster "$common"/host_aliases 2>/dev/null || true
fi

# 3. The qmaster.
install -d -o sgeadmin -g sgeadmin /run/gridengine
if [ -z "$(qmaster_pid)" ]; then
    say "starting sge_qmaster"
    /usr/sbin/sge_qmaster
    for _ in $(seq 120); do [ -n "$(qmaster_pid)" ] && qstat >/dev/null 2>&1 && break; sleep 0.5; done
    [ -n "$(qmaster_pid)" ] || fail "sge_qmaster did not start; see $spool/qmaster/messages"
    echo "qmaster $(qmaster_pid)" >>"$run_dir/pids"
fi
for _ in $(seq 60); do qstat >/dev/null 2>&1 && break; sleep 0.5; done
qstat >/dev/null || fail "the qmaster does not answer qstat"

# 4. Configuration, each part only when it differs.
edit=$(mktemp -d)
trap 'rm -rf "$edit"' EXIT
# qconf -m* runs $EDITOR on a temporary file: these editors are sed scripts.
printf '#!/bin/sh\nsed -i -e "s/^min_uid .*/min_uid 0/" -e "s/^min_gid .*/min_gid 0/" -e "s/^login_shells .*/login_shells sh,ksh,csh,tcsh/" "$1"\n' >"$edit/global"
printf '#!/bin/sh\nsed -i -e "s/^schedule_interval .*/schedule_interval 0:0:1/" -e "s/^flush_submit_sec .*/flush_submit_sec 1/" -e "s/^flush_finish_sec .*/flush_finish_sec 1/" "$1"\n' >"$edit/scheduler"
chmod +x "$edit/global" "$edit/scheduler"
# Root may run jobs (CI runs as root; the default refuses uid < 1000). Job scripts run by a
# plain, not a login, bash: a login shell reads the user's profile, and root's here runs
# `pyenv init`, whose `pyenv rehash` waits 60 s for a lock that a job deleted in the middle
# of it leaves behind (every later job then starts a minute late).
qconf -sconf global | grep -q '^login_shells *sh,ksh,csh,tcsh$' && qconf -sconf global | grep -q '^min_uid *0$' \
    || EDITOR="$edit/global" qconf -mconf global >/dev/null
# Schedule within a second, not every 15 s.
qconf -ssconf | grep -q '^schedule_interval *0:0:1$' || EDITOR="$edit/scheduler" qconf -msconf >/dev/null
qconf -sh 2>/dev/null | grep -qx "$host" || qconf -ah "$host" >/dev/null
qconf -ss 2>/dev/null | grep -qx "$host" || qconf -as "$host" >/dev/null
if ! qconf -se "$host" >/dev/null 2>&1; then
    printf 'hostname %s\nload_scaling NONE\ncomplex_values NONE\nuser_lists NONE\nxuser_lists NONE\nprojects NONE\nxprojects NONE\nusage_scaling NONE\nreport_variables NONE\n' \
        "$host" >"$edit/exechost"
    qconf -Ae "$edit/exechost" >/dev/null
fi
if ! qconf -sp smp >/dev/null 2>&1; then
    printf 'pe_name smp\nslots 9999\nuser_lists NONE\nxuser_lists NONE\nstart_proc_args NONE\nstop_proc_args NONE\nallocation_rule $pe_slots\ncontrol_slaves TRUE\njob_is_first_task TRUE\nurgency_slots min\naccounting_summary FALSE\nqsort_args NONE\n' \
        >"$edit/pe"
    qconf -Ap "$edit/pe" >/dev/null
fi
notify_hms=$(printf '00:00:%02d' "$notify")
if ! qconf -sq "$queue" >/dev/null 2>&1; then
    # load_thresholds NONE: a busy 2-core machine must not put the queue in alarm state.
    {
        printf 'qname %s\nhostlist %s\nseq_no 0\nload_thresholds NONE\nsuspend_thresholds NONE\n' "$queue" "$host"
        printf 'nsuspend 1\nsuspend_interval 00:05:00\npriority 0\nmin_cpu_interval 00:05:00\n'
        printf 'processors UNDEFINED\nqtype BATCH INTERACTIVE\nckpt_list NONE\npe_list smp\nrerun FALSE\n'
        printf 'slots %s\ntmpdir /tmp\nshell /bin/bash\nprolog NONE\nepilog NONE\n' "$slots"
        printf 'shell_start_mode posix_compliant\nstarter_method NONE\nsuspend_method NONE\n'
        printf 'resume_method NONE\nterminate_method NONE\nnotify %s\nowner_list NONE\n' "$notify_hms"
        printf 'user_lists NONE\nxuser_lists NONE\nsubordinate_list NONE\ncomplex_values NONE\n'
        printf 'projects NONE\nxprojects NONE\ncalendar NONE\ninitial_state default\n'
        for limit in rt cpu fsize data stack core rss vmem; do
            printf 's_%s INFINITY\nh_%s INFINITY\n' "$limit" "$limit"
        done
    } >"$edit/queue"
    qconf -Aq "$edit/queue" >/dev/null
else
    qconf -sq "$queue" | awk '$1 == "hostlist"' | grep -qw "$host" || qconf -aattr queue hostlist "$host" "$queue" >/dev/null
    qconf -sq "$queue" | grep -q "^notify *$notify_hms$" || qconf -mattr queue notify "$notify_hms" "$queue" >/dev/null
fi

# 5. The execution daemon; wait until the queue instance reports a load (not "au").
if [ -z "$(execd_pid)" ]; then
    say "starting sge_execd"
    SGE_EXECD_PIDFILE=/run/gridengine/execd.pid /usr/sbin/sge_execd
    for _ in $(seq 60); do [ -n "$(execd_pid)" ] && break; sleep 0.5; done
    [ -n "$(execd_pid)" ] || fail "sge_execd did not start; see $spool/execd/*/messages"
    echo "execd $(execd_pid)" >>"$run_dir/pids"
fi
for _ in $(seq 120); do
    line=$(qstat -f -q "$queue@$host" 2>/dev/null | awk -v q="$queue@$host" '$1 == q')
    load=$(echo "$line" | awk '{print $4}')
    state=$(echo "$line" | awk '{print $6}')
    [ -n "$load" ] && [ "$load" != "-NA-" ] && [[ "$state" != *a* && "$state" != *u* ]] && break
    sleep 0.5
done

# 6. A job must run end to end.
out=$(cd /tmp && timeout 120 qsub -sync y -b y -o /dev/null -e /dev/null -N dask-pcm-sge-check true 2>&1) ||
    fail "a test job did not run: $out"
say "ready in $(($(date +%s) - started)) s: queue $queue@$host, $slots slots, notify $notify_hms"
