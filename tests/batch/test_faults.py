"""run_batch under faults of the run itself, with a plain function: a unit that never returns
while the others finish, a scheduler process killed during the run and one killed during a
call to it. Each fault is real (a task blocked, ``dask scheduler`` sent SIGKILL)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import dask
import pytest
from distributed import Client

import dask_pcm
from dask_pcm.batch.segments import INDEX, read_predictions
from dask_pcm.exceptions import ClusterLostError

RELEASE = threading.Event()
#: The ids of the rows :func:`stuck_on_row_one` has returned (the workers run in this process).
RETURNED: list[int] = []


def stuck_on_row_one(rows):
    """Doubles each id; the unit holding id 1 does not return until RELEASE is set."""
    if any(r["id"] == 1 for r in rows):
        RELEASE.wait(300)
    RETURNED.extend(r["id"] for r in rows)
    return [{"id": r["id"], "double": 2 * r["id"]} for r in rows]


def test_finished_units_are_written_on_time_while_a_unit_never_returns(make_cluster, tmp_path):
    """Only a new finished unit used to flush: with one unit stuck, the others stayed in
    memory far past the flush interval, lost if the run was killed.

    Which units finish while one is stuck is Dask's choice: a task queued behind the stuck
    one on its worker waits with it (unless it is stolen). So the test waits until the
    units returned have stopped changing, then asks that the disk holds exactly them."""
    interval = 3.0
    settings = {"pcm.batch.flush-interval": f"{interval}s", "pcm.batch.task-seconds": 0}
    client = make_cluster(n_workers=2, config=settings)
    RELEASE.clear()
    RETURNED.clear()
    out = tmp_path / "out"
    outcome: dict[str, object] = {}

    def run() -> None:
        rows = [{"id": i} for i in range(30)]
        try:
            outcome["result"] = dask_pcm.run_batch(
                stuck_on_row_one, rows, cluster=client, rows_per_unit=3, output=out, progress=False
            )
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    try:
        # Settled: no unit returned for the flush interval and two of the dispatch's ticks;
        # by then every returned row must be on disk.
        deadline = time.monotonic() + 120
        seen, since = -1, time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.1)
            if len(RETURNED) != seen:
                seen, since = len(RETURNED), time.monotonic()
            elif seen and time.monotonic() - since > interval + 2:
                break
        returned = sorted(RETURNED)
        assert 1 not in returned and len(returned) >= 3, returned
        written = sorted(read_predictions(out)["id"]) if (out / INDEX).exists() else []
        assert written == returned, f"{len(written)} of the {len(returned)} returned rows on disk"
        assert thread.is_alive()  # the stuck unit still runs
    finally:
        RELEASE.set()
        thread.join(60)
    assert "error" not in outcome, outcome.get("error")
    assert sorted(read_predictions(out)["id"]) == list(range(30))


@pytest.fixture
def own_scheduler(tmp_path):
    """A scheduler process and one worker process, as ``dask scheduler`` / ``dask worker``
    start them: ``(address, scheduler process)``. They import this module as the client
    does (a user's functions must be importable on the cluster)."""
    scheduler_file = tmp_path / "scheduler.json"
    dask_bin = Path(sys.executable).with_name("dask")
    argv = [dask_bin, "scheduler", "--port", "0", "--dashboard-address", ":0"]
    argv += ["--scheduler-file", str(scheduler_file)]
    root = str(Path(__file__).parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    scheduler = subprocess.Popen(argv, env=env, stderr=subprocess.DEVNULL)
    worker = None
    try:
        deadline = time.monotonic() + 60
        while not scheduler_file.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        address = json.loads(scheduler_file.read_text())["address"]
        worker = subprocess.Popen(
            [dask_bin, "worker", address, "--nthreads", "1", "--death-timeout", "5"],
            env=env,
            stderr=subprocess.DEVNULL,
        )
        yield address, scheduler
    finally:
        for process in (worker, scheduler):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait(30)


def slow_double(rows, started):
    """Doubles each id, 20 ms a unit; the first unit creates the file ``started``."""
    Path(started).touch()
    time.sleep(0.02)
    return [{"id": r["id"], "double": 2 * r["id"]} for r in rows]


def _run(client: Client, tmp_path: Path) -> None:
    rows = [{"id": i} for i in range(400)]
    dask_pcm.run_batch(
        slow_double, rows, cluster=client, rows_per_unit=1, output=tmp_path / "out",
        progress=False, started=str(tmp_path / "started"),
    )  # fmt: skip


def test_a_killed_scheduler_is_named_not_a_cancelled_task(tmp_path, own_scheduler):
    """The client used to say "task ... ended as 'cancelled', not finished"."""
    address, scheduler = own_scheduler
    with Client(address) as client:
        client.wait_for_workers(1, timeout=60)

        def kill_soon() -> None:
            deadline = time.monotonic() + 60
            while not (tmp_path / "started").exists() and time.monotonic() < deadline:
                time.sleep(0.05)  # until units run
            time.sleep(0.5)
            scheduler.send_signal(signal.SIGKILL)

        killer = threading.Thread(target=kill_soon)
        killer.start()
        start = time.monotonic()
        with pytest.raises(ClusterLostError, match=f"scheduler at {address}"):
            _run(client, tmp_path)
        killer.join()
        assert time.monotonic() - start < 40


def _killed_at_the_second_check(tmp_path, own_scheduler, client_gone) -> None:
    """Run :func:`_run` with tasks timed, so that the run checks the scheduler for overdue
    tasks every second; at the second check, kill the scheduler and wait until
    ``client_gone(client)``, then let the check's call go on. The run must end with
    :class:`ClusterLostError` naming the scheduler."""
    address, scheduler = own_scheduler
    settings = {"distributed.comm.timeouts.connect": "3s", "pcm.batch.task-timeout": 600}
    with dask.config.set(settings), Client(address) as client:
        client.wait_for_workers(1, timeout=60)
        call = client.run_on_scheduler
        checks = []

        def killed_at_check(function, *args, **kwargs):
            if function.__name__ == "_executing":
                checks.append(1)
                if len(checks) == 2:  # a second into the run, units running
                    scheduler.send_signal(signal.SIGKILL)
                    scheduler.wait(30)
                    deadline = time.monotonic() + 60
                    while not client_gone(client) and time.monotonic() < deadline:
                        time.sleep(0.05)
                    assert client_gone(client), client.status
            return call(function, *args, **kwargs)

        client.run_on_scheduler = killed_at_check  # type: ignore[method-assign]
        with pytest.raises(ClusterLostError, match=f"scheduler at {address}"):
            _run(client, tmp_path)
        assert len(checks) == 2 and (tmp_path / "started").exists()


def test_a_scheduler_killed_during_a_call_to_it_is_named(tmp_path, own_scheduler):
    """A scheduler that dies while the run waits on a call to it (here the check for overdue
    tasks, made every second when tasks have a timeout) used to end the run with the call's
    own ``OSError: Timed out trying to connect to ...`` (seen in CI, where the kill landed
    during such a call)."""
    # The call goes on once the client has seen its connection close (it reconnects).
    _killed_at_the_second_check(tmp_path, own_scheduler, lambda c: c.status != "running")


def test_a_scheduler_gone_until_the_client_closes_is_named(tmp_path, own_scheduler):
    """A scheduler that stays gone until the client gives up reconnecting and closes: the
    run's next call to it used to end the run with what the closed client raised,
    ``AttributeError: 'NoneType' object has no attribute 'run_function'`` here, or
    ``RuntimeError: ConnectionPool is closed`` (seen in CI, with the client's link cut for
    30 s on the emulated hosts)."""
    _killed_at_the_second_check(tmp_path, own_scheduler, lambda c: c.status == "closed")
