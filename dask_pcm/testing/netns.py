"""The machine side of :mod:`dask_pcm.testing.hosts`: commands, shapers, the lock, cleanup.

Everything here names what it creates with :data:`PREFIX`, so that :func:`cleanup` can find
and remove it whoever left it behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TextIO

PREFIX = "pcmh"
BRIDGE = f"{PREFIX}br"
LOCK_FILE = Path(tempfile.gettempdir()) / f"{PREFIX}.lock"
TOOLS = ("ip", "tc", "ebtables")


class HostsError(RuntimeError):
    """The emulated network could not be set up or changed; the message quotes the command."""


def unavailable() -> str | None:
    """Why no emulated network can run here (not root, a tool missing), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not on PATH (sudo bash ci/hosts/setup.sh installs them)"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode:
        return f"ip netns does not work here: {probe.stderr.strip()}"
    return None


def run(*argv: str, check: bool = True) -> str:
    """The output of command ``argv``; with ``check``, a failure raises :class:`HostsError`."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if check and done.returncode:
        raise HostsError(f"{shlex.join(argv)} failed: {(done.stderr or done.stdout).strip()}")
    return done.stdout


def take_lock(timeout: float) -> TextIO:
    """The machine's one emulated network: an ``flock`` on :data:`LOCK_FILE` (released when
    the returned file is closed, or its process dies), waiting up to ``timeout`` seconds."""
    lock = open(LOCK_FILE, "a+")  # noqa: SIM115  (held until the network closes)
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() > deadline:
                lock.seek(0)
                holder = lock.read().strip() or "unknown"
                lock.close()
                raise HostsError(
                    f"another emulated network holds {LOCK_FILE} (process {holder}) "
                    f"for more than {timeout:g} s"
                ) from None
            time.sleep(0.5)
    lock.truncate(0)
    lock.write(str(os.getpid()))
    lock.flush()
    return lock


def shape(namespace: str | None, device: str, mbit: float | None) -> None:
    """Cap ``device``'s egress at ``mbit`` Mbit/s (a token bucket); None removes the cap."""
    where = ["-n", namespace] if namespace else []
    if mbit is None:
        run("tc", *where, "qdisc", "del", "dev", device, "root", check=False)
        return
    rate = int(mbit * 1e6)
    # 10 ms of traffic, and never less than a few full-size frames: the bucket's depth only
    # decides how bursty the rate is, not the rate itself.
    burst = max(16 * 1024, rate // 8 // 100)
    run("tc", *where, "qdisc", "replace", "dev", device, "root", "tbf",
         "rate", f"{rate}bit", "burst", str(burst), "latency", "100ms")  # fmt: skip


# -- what is left, and removing it ---------------------------------------------------------
def _namespaces() -> list[str]:
    names = [line.split()[0] for line in run("ip", "netns", "list").splitlines() if line.strip()]
    return [n for n in names if n.startswith(PREFIX)]


def _links() -> list[str]:
    out = run("ip", "-o", "link", "show")
    names = [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]
    return [n for n in names if n.startswith(PREFIX)]


def _bridge_rules() -> list[tuple[str, str]]:
    """``(chain, rule)`` of every ebtables rule that names a ``pcmh`` interface."""
    if shutil.which("ebtables") is None:
        return []
    rules, chain = [], ""
    for line in run("ebtables", "-L").splitlines():
        if line.startswith("Bridge chain:"):
            chain = line.split(":")[1].split(",")[0].strip()
        elif PREFIX in line:
            rules.append((chain, line.strip()))
    return rules


def _ip_rules() -> list[tuple[str, str]]:
    """``(table, rule)`` of every iptables rule that mentions ``pcmh``."""
    if shutil.which("iptables-save") is None:
        return []
    rules, table = [], "filter"
    for line in run("iptables-save").splitlines():
        if line.startswith("*"):
            table = line[1:]
        elif line.startswith("-A") and PREFIX in line:
            rules.append((table, line))
    return rules


def leftovers() -> list[str]:
    """Every ``pcmh`` namespace, network device, bridge or iptables rule on this machine."""
    return (
        [f"namespace {n}" for n in _namespaces()]
        + [f"link {n}" for n in _links()]
        + [f"ebtables {chain}: {rule}" for chain, rule in _bridge_rules()]
        + [f"iptables {table}: {rule}" for table, rule in _ip_rules()]
    )


def cleanup() -> list[str]:
    """Remove everything :func:`leftovers` lists (the processes in a namespace are killed
    first: they were started in it); return what was removed."""
    found = leftovers()
    for name in _namespaces():
        for pid in run("ip", "netns", "pids", name, check=False).split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        run("ip", "netns", "del", name, check=False)
    for name in _links():
        run("ip", "link", "del", name, check=False)
    for chain, rule in _bridge_rules():
        run("ebtables", "-D", chain, *rule.split(), check=False)
    for table, rule in _ip_rules():
        run("iptables", "-t", table, "-D", *shlex.split(rule)[1:], check=False)
    remaining = leftovers()
    if remaining:
        raise HostsError(f"could not remove: {'; '.join(remaining)}")
    return found
