#!/usr/bin/env bash
# Install what dask_pcm's emulated hosts need (dask_pcm.testing.hosts, the `hosts` tests and
# benchmarks/scale_out.py --hosts): iproute2 (ip netns, veth, bridges, tc's tbf shaper) and
# iptables (whose Debian package brings ebtables, which cuts a host off at the bridge). Runs
# as root; idempotent: what is installed already is left as it is. Then removes whatever a
# killed run left behind (every pcmh* namespace, veth, bridge and rule).
#
#   sudo bash ci/hosts/setup.sh
set -euo pipefail

say() { echo "[ci/hosts/setup $(date +%T)] $*" >&2; }
fail() { echo "[ci/hosts/setup] error: $*" >&2; exit 1; }
[ "$(id -u)" -eq 0 ] || fail "run as root (it installs Debian packages; namespaces need root)"

missing=""
command -v ip >/dev/null && command -v tc >/dev/null || missing="$missing iproute2"
command -v iptables >/dev/null && command -v ebtables >/dev/null || missing="$missing iptables"
if [ -n "$missing" ]; then
    say "installing$missing"
    [ "${PCM_HOSTS_SKIP_APT_UPDATE:-0}" = 1 ] || apt-get update -qq
    # shellcheck disable=SC2086
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing >/dev/null
fi
ip netns list >/dev/null || fail "ip netns does not work here (a kernel without network namespaces?)"
ebtables -L >/dev/null || fail "ebtables cannot read the bridge filter table"

here=$(cd "$(dirname "$0")/../.." && pwd)
python=${PYTHON:-$(command -v python || command -v python3)}
if (cd "$here" && "$python" -c "import dask_pcm" 2>/dev/null); then
    (cd "$here" && "$python" -m dask_pcm.testing.hosts --cleanup)
fi
say "ready: ip $(ip -V | awk '{print $NF}'), $(iptables --version)"
