"""The emulated hosts themselves: a capped link carries its cap, a cut host is silent until
restored, and nothing is left behind: not after a test body raises, nor after a process that
held a network was killed."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dask_pcm.testing import hosts
from tests.conftest import wait_for
from tests.hosts.conftest import require_hosts

pytestmark = pytest.mark.hosts

PORT = 9917
# A host's side of a transfer: receive everything each connection sends and answer with the
# count ("sink"), or send ``n`` bytes to an address and print the seconds ("source").
PEER = f"""
import socket, sys, time
mode, address, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
if mode == "sink":
    server = socket.create_server((address, {PORT}))
    while True:
        conn, _ = server.accept()
        got = 0
        while data := conn.recv(1 << 16):
            got += len(data)
        conn.sendall(str(got).encode())
        conn.close()
else:
    conn = socket.create_connection((address, {PORT}), timeout=30)
    start = time.perf_counter()
    conn.sendall(bytes(n))
    conn.shutdown(socket.SHUT_WR)
    conn.recv(16)
    print(time.perf_counter() - start, flush=True)
"""


def _connect(address: str, seconds: float = 10) -> socket.socket:
    """A connection to ``address``:PORT once something listens there."""

    def attempt() -> socket.socket | None:
        try:
            return socket.create_connection((address, PORT), timeout=2)
        except ConnectionRefusedError:
            return None

    return wait_for(attempt, seconds, f"a listener on {address}:{PORT}")


def _send(conn: socket.socket, nbytes: int) -> float:
    """Seconds to send ``nbytes`` and have the receiver count them."""
    start = time.perf_counter()
    conn.sendall(bytes(nbytes))
    conn.shutdown(socket.SHUT_WR)
    assert int(conn.recv(32)) == nbytes
    return time.perf_counter() - start


def test_a_link_carries_its_cap_each_way(network):
    host = network.add_host(upload=16, download=32)  # Mbit/s
    nbytes = 6_000_000

    host.popen([sys.executable, "-c", PEER, "sink", host.address, "0"], log="sink")
    with _connect(host.address) as conn:
        download = nbytes * 8 / _send(conn, nbytes) / 1e6

    with socket.create_server((network.address, PORT)) as server:
        sender = host.popen(
            [sys.executable, "-c", PEER, "source", network.address, str(nbytes)], log="source"
        )
        conn, _ = server.accept()
        with conn:
            got = 0
            while data := conn.recv(1 << 16):
                got += len(data)
            conn.sendall(str(got).encode())
        assert sender.wait(30) == 0, host.log("source")
    upload = nbytes * 8 / float(host.log("source").split()[-1]) / 1e6
    # A shaper never lets more through than its rate; TCP over it reaches most of it.
    assert 0.8 * 32 <= download <= 1.05 * 32, download
    assert 0.8 * 16 <= upload <= 1.05 * 16, upload


def test_a_cut_host_is_silent_until_restored(network):
    host, other = network.add_host(), network.add_host()
    host.popen([sys.executable, "-c", PEER, "sink", host.address, "0"], log="sink")
    with _connect(host.address) as conn:
        assert _send(conn, 1000) < 5
    with host.cut_off():
        assert any(host.outside in rule for rule in hosts.leftovers())
        # Silence, not a refusal: from this machine and from the other host alike.
        with pytest.raises((TimeoutError, OSError)) as refused:
            socket.create_connection((host.address, PORT), timeout=2)
        assert not isinstance(refused.value, ConnectionRefusedError)
        probe = other.popen([sys.executable, "-c", PEER, "source", host.address, "10"], log="probe")
        assert probe.wait(60) != 0
        assert "timed out" in other.log("probe") or "No route" in other.log("probe")
    assert not any("ebtables" in x for x in hosts.leftovers())
    with _connect(host.address) as conn:
        assert _send(conn, 1000) < 5


def test_nothing_is_left_behind_when_the_test_body_raises(tmp_path):
    require_hosts()
    with (
        pytest.raises(RuntimeError, match="the test body failed"),
        hosts.HostNetwork(hosts=2, link=50, directory=tmp_path) as net,
    ):
        net.hosts[0].cut()
        sleeper = net.hosts[1].popen([sys.executable, "-c", "import time; time.sleep(600)"])
        present = hosts.leftovers()
        for name in ("namespace pcmh1", "namespace pcmh2", "link pcmhbr", "link pcmh1h"):
            assert name in present
        assert any(x.startswith("ebtables") for x in present)
        raise RuntimeError("the test body failed")
    assert hosts.leftovers() == []
    assert sleeper.poll() is not None  # stopped, not orphaned


KILLED = """
import os, signal, sys, time
from dask_pcm.testing.hosts import HostNetwork
net = HostNetwork(hosts=2, link=10, directory=sys.argv[1])
net.hosts[0].cut()
net.hosts[1].popen([sys.executable, "-c", "import time; time.sleep(600)"])
print("up", flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # no atexit, no context manager: what a killed test leaves
"""


def test_what_a_killed_run_leaves_is_removed_by_cleanup(tmp_path):
    require_hosts()
    run = subprocess.run(
        [sys.executable, "-c", KILLED, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == -signal.SIGKILL and "up" in run.stdout, run.stderr
    left = hosts.leftovers()
    assert "namespace pcmh2" in left and any(x.startswith("ebtables") for x in left)
    sleepers = hosts.run("ip", "netns", "pids", "pcmh2").split()
    assert sleepers  # the host's process outlived its parent
    cli = subprocess.run(
        [sys.executable, "-m", "dask_pcm.testing.hosts", "--cleanup"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cli.returncode == 0, cli.stderr
    assert "removed namespace pcmh2" in cli.stdout
    assert hosts.leftovers() == []
    for pid in sleepers:
        assert not Path(f"/proc/{pid}").exists() or _zombie(int(pid))


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


def test_a_second_network_waits_for_the_first(tmp_path):
    require_hosts()
    with (
        hosts.HostNetwork(directory=tmp_path / "a"),
        pytest.raises(hosts.HostsError, match="another emulated network holds"),
    ):
        hosts.HostNetwork(directory=tmp_path / "b", lock_timeout=0.5)


def test_the_simulated_shared_filesystem_is_one_for_all_hosts(network):
    """Reads booked on pcm.template.source-bandwidth from two hosts share one link, as the
    readers of one shared filesystem do (each host has its own lock folder)."""
    import dask

    from dask_pcm.templates.throttle import SharedBandwidth

    first, second = network.add_host(), network.add_host()
    ends = []
    for host in (first, second):
        with dask.config.set({"pcm.lock-directory": str(host.lock_directory)}):
            ends.append(SharedBandwidth(1e6, name="template-source").book(1_000_000) - time.time())
    assert ends[0] == pytest.approx(1.0, abs=0.2)
    assert ends[1] == pytest.approx(2.0, abs=0.2)  # queued behind the first host's read
    network.reset_source()
    with dask.config.set({"pcm.lock-directory": str(second.lock_directory)}):
        assert SharedBandwidth(1e6, name="template-source").book(10) - time.time() < 0.1


TERMINATED = """
import sys, time
from dask_pcm.testing.hosts import HostNetwork
with HostNetwork(hosts=2, link=10, directory=sys.argv[1]) as net:
    net.hosts[0].cut()
    net.hosts[1].popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print("up", flush=True)
    time.sleep(600)
"""


def test_a_run_stopped_with_sigterm_removes_its_network(tmp_path):
    """``timeout`` and CI runners stop a job with SIGTERM, which Python's default handler
    obeys without running atexit or leaving a with block."""
    require_hosts()
    proc = subprocess.Popen(
        [sys.executable, "-c", TERMINATED, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "up"
        assert "namespace pcmh2" in hosts.leftovers()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
    assert hosts.leftovers() == []
