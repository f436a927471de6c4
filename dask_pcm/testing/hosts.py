"""Many hosts on one machine: network namespaces on a private bridge, with capped links.

On the clusters dask_pcm is for, every worker is its own host behind its own network link,
and links fail. :class:`HostNetwork` emulates that on one Linux machine, as root: each
:class:`Host` is a network namespace with its own address on a private bridge (``pcmhbr``,
``10.213.0.0/24``; the bridge itself, ``10.213.0.1``, is where a scheduler in this process
listens), a link capped up and down (a ``tbf`` shaper on each end of its veth pair), its own
folders (a worker's local directory, ``pcm.lock-directory`` and
``pcm.worker.template-directory``; the simulated shared filesystem of
``pcm.template.source-bandwidth`` is one for all hosts), and the processes started in it (:meth:`Host.start_worker`
runs ``dask worker`` there). :meth:`Host.cut` drops every frame to and from the host at the
bridge (``ebtables``, which Debian's iptables package installs), silently, as a dead switch
port would; :meth:`Host.restore` lets them through again.

Everything is named with the prefix ``pcmh``. :func:`cleanup` removes every ``pcmh``
namespace (after killing the processes in it), veth, bridge and rule, whoever left it;
:class:`HostNetwork` runs it when it starts (the leftovers of a run that was killed) and when it
closes (as a context manager, and at exit). ``python -m dask_pcm.testing.hosts --cleanup``
does the same by hand. One emulated network runs at a time on a machine (a lock file).

What it does not model: latency and loss (``netem`` is not in every kernel), real NICs, and
cores (every host shares the machine's); see ``docs/hosts.md``.

Example
-------
>>> with HostNetwork(hosts=2, link=100) as net:            # doctest: +SKIP
...     cluster = dask_pcm.local_cluster(n_workers=0, host=net.address)
...     for host in net.hosts:
...         host.start_worker(cluster.scheduler_address)
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from dask_pcm.templates.throttle import SharedBandwidth
from dask_pcm.testing.netns import (
    BRIDGE,
    PREFIX,
    HostsError,
    cleanup,
    leftovers,
    run,
    shape,
    take_lock,
    unavailable,
)

__all__ = [
    "Host",
    "HostNetwork",
    "HostsError",
    "cleanup",
    "dask_environ",
    "leftovers",
    "unavailable",
]

SUBNET = "10.213.0"
# Hosts get SUBNET.(FIRST + i): the bridge is .1, the low addresses are left free.
FIRST = 10
MAX_HOSTS = 200
# The bridge chains a cut host's frames are dropped in: from it, to it, to and from this
# machine's own stack (where the scheduler listens).
_CUT_RULES = (("FORWARD", "-i"), ("FORWARD", "-o"), ("INPUT", "-i"), ("OUTPUT", "-o"))


def dask_environ(settings: Mapping[str, Any]) -> dict[str, str]:
    """Dask settings (``{"pcm.template.chunk-size": "1 MiB"}``) as the environment variables
    that set them in a process started with it (``DASK_PCM__TEMPLATE__CHUNK_SIZE``)."""
    out = {}
    for key, value in settings.items():
        name = "DASK_" + "__".join(part.replace("-", "_").upper() for part in key.split("."))
        out[name] = value if isinstance(value, str) else repr(value)
    return out


def _exit_on_sigterm() -> None:
    """Make SIGTERM (``timeout``, a CI runner stopping a job) unwind the main thread like an
    exception, so that context managers and ``atexit`` remove the network: Python's default
    for it ends the process at once. A handler someone else installed is left alone."""
    in_main = threading.current_thread() is threading.main_thread()
    if in_main and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


class Host:
    """One emulated host: a namespace, its address and link, its folders and processes."""

    def __init__(self, network: HostNetwork, index: int) -> None:
        self.network = network
        self.index = index
        self.name = f"{PREFIX}{index}"
        self.address = f"{SUBNET}.{FIRST + index}"
        self.outside = f"{self.name}h"  # the veth end on the bridge (the host's download)
        self.inside = f"{self.name}n"  # the end in the namespace (its upload)
        self.directory = network.directory / self.name
        self.upload: float | None = None
        self.download: float | None = None
        self.processes: list[subprocess.Popen[bytes]] = []
        self.is_cut = False

    def __repr__(self) -> str:
        return f"<Host {self.name} {self.address} up {self.upload} down {self.download} Mbit/s>"

    @property
    def lock_directory(self) -> Path:
        return self.directory / "locks"

    @property
    def template_directory(self) -> Path:
        return self.directory / "templates"

    @property
    def local_directory(self) -> Path:
        return self.directory / "scratch"

    def _create(self) -> None:
        for folder in (self.lock_directory, self.template_directory, self.local_directory):
            folder.mkdir(parents=True, exist_ok=True)
        # The simulated shared filesystem is one for the whole cluster, not one per host.
        shared = self.lock_directory / self.network.source_state.name
        if not shared.is_symlink():
            shared.symlink_to(self.network.source_state)
        run("ip", "netns", "add", self.name)
        run("ip", "link", "add", self.outside, "type", "veth", "peer", "name", self.inside)
        run("ip", "link", "set", self.inside, "netns", self.name)
        run("ip", "link", "set", self.outside, "master", BRIDGE, "up")
        run("ip", "-n", self.name, "addr", "add", f"{self.address}/24", "dev", self.inside)
        run("ip", "-n", self.name, "link", "set", self.inside, "up")
        run("ip", "-n", self.name, "link", "set", "lo", "up")

    def shape(self, upload: float | None = None, download: float | None = None) -> None:
        """Cap the host's link at ``upload`` and ``download`` Mbit/s (None: uncapped)."""
        shape(self.name, self.inside, upload)
        shape(None, self.outside, download)
        self.upload, self.download = upload, download

    def cut(self) -> None:
        """Drop every frame to and from this host at the bridge, without a word to anyone."""
        if not self.is_cut:
            for chain, side in _CUT_RULES:
                run("ebtables", "-A", chain, side, self.outside, "-j", "DROP")
            self.is_cut = True

    def restore(self) -> None:
        """Let the host's frames through again (after :meth:`cut`)."""
        for chain, side in _CUT_RULES:
            run("ebtables", "-D", chain, side, self.outside, "-j", "DROP", check=False)
        self.is_cut = False

    @contextlib.contextmanager
    def cut_off(self) -> Iterator[Host]:
        """``with host.cut_off(): ...``: cut for the block, restored after it."""
        self.cut()
        try:
            yield self
        finally:
            self.restore()

    def environ(self) -> dict[str, str]:
        """What a process of this host finds in its environment: its own lock and template
        folders, and the network's ``settings``."""
        return {
            **dask_environ(self.network.settings),
            **dask_environ({
                "pcm.lock-directory": str(self.lock_directory),
                "pcm.worker.template-directory": str(self.template_directory),
            }),
            "PCM_HOST": self.name,
        }  # fmt: skip

    def popen(
        self, argv: Sequence[str], env: Mapping[str, str] | None = None, log: str = "process"
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` in this host's namespace, in a process group of its own, output to
        ``<directory>/<log>.log``; it is stopped when the network closes."""
        environ = {**os.environ, **self.environ(), "PYTHONUNBUFFERED": "1", **(env or {})}
        with open(self.directory / f"{log}.log", "ab") as out:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", self.name, *argv],
                env=environ,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.processes.append(proc)
        return proc

    def start_worker(
        self,
        scheduler: str,
        nthreads: int = 1,
        nanny: bool = True,
        env: Mapping[str, str] | None = None,
        args: Sequence[str] = (),
    ) -> subprocess.Popen[bytes]:
        """``dask worker`` in this host, named after it, connecting to ``scheduler``."""
        argv = [
            sys.executable, "-m", "distributed.cli.dask_worker", scheduler,
            "--host", self.address, "--name", self.name, "--nthreads", str(nthreads),
            "--local-directory", str(self.local_directory), "--no-dashboard",
            "--nanny" if nanny else "--no-nanny", *args,
        ]  # fmt: skip
        return self.popen(argv, env, log="worker")

    def log(self, name: str = "worker") -> str:
        """What the host's process ``name`` wrote so far (for a failing test's message)."""
        path = self.directory / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self, timeout: float = 5.0) -> None:
        """Stop this host's processes: SIGTERM to each group, SIGKILL after ``timeout``."""
        for proc in self.processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, deadline - time.monotonic()))
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.processes.clear()


class HostNetwork:
    """A private bridge and ``hosts`` emulated hosts, each with a link of ``link`` Mbit/s
    each way (None: uncapped); removed on :meth:`close`, and by a context manager's exit.

    ``directory`` holds every host's folders (a temporary one by default, removed at the
    end); ``settings`` are Dask settings given to every process started in a host.
    """

    def __init__(
        self,
        hosts: int = 0,
        link: float | None = None,
        directory: str | os.PathLike[str] | None = None,
        settings: Mapping[str, Any] | None = None,
        lock_timeout: float = 120.0,
    ) -> None:
        self._owned = directory is None
        self.directory = Path(directory or tempfile.mkdtemp(prefix=f"{PREFIX}-"))
        self.settings = dict(settings or {})
        self.hosts: list[Host] = []
        self.address = f"{SUBNET}.1"
        # pcm.template.source-bandwidth books reads on a state file in the lock folder
        # (dask_pcm.templates.throttle); every host's links to this one.
        name = Path(SharedBandwidth(1, name="template-source")._path).name
        self.source_state = self.directory / name
        self._lock: TextIO | None = take_lock(lock_timeout)
        _exit_on_sigterm()
        try:
            cleanup()  # whatever a killed run left behind
            run("ip", "link", "add", BRIDGE, "type", "bridge")
            run("ip", "addr", "add", f"{self.address}/24", "dev", BRIDGE)
            run("ip", "link", "set", BRIDGE, "up")
            atexit.register(self.close)
            for _ in range(hosts):
                self.add_host(link)
        except BaseException:
            self.close()
            raise

    def add_host(
        self, link: float | None = None, upload: float | None = None, download: float | None = None
    ) -> Host:
        """A new host on the bridge, its link capped at ``link`` Mbit/s each way, or at
        ``upload`` and ``download``."""
        if self._lock is None:
            raise HostsError("the emulated network is closed")
        if len(self.hosts) >= MAX_HOSTS:
            raise HostsError(f"at most {MAX_HOSTS} hosts on {SUBNET}.0/24")
        host = Host(self, len(self.hosts) + 1)
        self.hosts.append(host)
        host._create()
        up, down = (upload, download) if (upload or download) else (link, link)
        host.shape(up, down)
        return host

    def reset_source(self) -> None:
        """Forget the simulated shared filesystem's bookings (a new benchmark round)."""
        self.source_state.unlink(missing_ok=True)

    def close(self) -> None:
        """Stop every process, remove every namespace, veth, the bridge and the rules."""
        if self._lock is None:
            return
        try:
            for host in self.hosts:
                host.stop()
            cleanup()
            if self._owned:
                shutil.rmtree(self.directory, ignore_errors=True)
        finally:
            atexit.unregister(self.close)
            self._lock.close()
            self._lock = None

    def __enter__(self) -> HostNetwork:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="The emulated hosts of dask_pcm's tests.")
    p.add_argument("--cleanup", action="store_true", help=f"remove every {PREFIX}* leftover")
    p.add_argument("--list", action="store_true", help=f"list {PREFIX}* leftovers")
    args = p.parse_args(argv)
    if args.cleanup:
        with take_lock(10.0):  # never under a network that is running
            removed = cleanup()
        print("\n".join(f"removed {x}" for x in removed) or "nothing to remove")
    elif args.list:
        print("\n".join(leftovers()) or "nothing left")
    else:
        p.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
