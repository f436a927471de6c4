"""FEVER runs across emulated hosts whose network fails: a worker holding the ready context
cut off mid-run, and the client's own link to the scheduler cut for 30 s. Frames are dropped
at the bridge, silently, both ways; every worker is a process in its own namespace."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from dask_pcm.apps.fever.run import CONTEXT, run_fever
from dask_pcm.batch.segments import read_predictions
from tests.conftest import wait_for
from tests.hosts.conftest import cluster_on, start_workers, status_of, wait_ready

# Each takes 40-80 s here (worker processes importing torch on 2 shared cores, a 30 s cut).
pytestmark = [pytest.mark.hosts, pytest.mark.slow, pytest.mark.soak]

# A peer that stops answering is declared dead after this long (TCP user timeout and
# keepalive: distributed.comm.timeouts.tcp), on every side.
TCP_TIMEOUT = "12s"  # distributed refuses less than 11 s


def _claims(path: Path, n: int) -> Path:
    with open(path, "w") as f:
        for i in range(n):
            label = ("SUPPORTS", "REFUTES", "NOT ENOUGH INFO")[i % 3]
            f.write(json.dumps({"id": i, "label": label, "claim": f"Fact number {i}."}) + "\n")
    return path


def _tasks_on(client, worker: str) -> int:
    table = status_of(client, CONTEXT)
    return int(table.loc[worker, "tasks"]) if worker in table.index else 0


def test_a_worker_cut_off_mid_run_has_its_rows_run_elsewhere_and_is_replaced(
    network, tiny_model_dir, tmp_path
):
    """Once one of the three hosts' workers has scored some units, its frames are dropped
    at the bridge (both ways). Its tasks run on the other two, every row once, and the run
    completes. The cut worker gives up on the scheduler by itself (distributed's TCP
    timeout) and ends; reconnected, a worker started on that host (a batch system's
    replacement job) joins and gets the context ready."""
    settings = {
        "pcm.cache-directory": str(tmp_path / "cache"),
        "distributed.comm.timeouts.tcp": TCP_TIMEOUT,
    }
    data, output = _claims(tmp_path / "claims.jsonl", 1500), tmp_path / "preds"
    hosts = [network.add_host(link=100) for _ in range(3)]
    with cluster_on(network, settings) as (cluster, client):
        workers = start_workers(client, cluster.scheduler_address, hosts)
        cut: dict[str, Any] = {}

        def cut_when_busy() -> None:
            # The first worker to have scored two units is cut: which one gets work first
            # depends on which is ready first, not on the host's place in the list.
            busy = wait_for(
                lambda: [h for h in hosts if _tasks_on(client, workers[h.name]) >= 2],
                180,
                "tasks done on a worker",
            )
            busy[0].cut()
            cut.update(host=busy[0], at=time.monotonic())

        cutter = threading.Thread(target=cut_when_busy)
        cutter.start()
        result = run_fever(
            data,
            model=tiny_model_dir,
            templates=["direct"],
            cluster=client,
            claims_per_task=4,
            output=output,
            progress=False,
        )
        cutter.join()
        assert "at" in cut, "the run ended before a worker was cut"
        finished = time.monotonic() - cut["at"]
        victim = cut["host"]
        address = workers[victim.name]
        # The run may end before the scheduler declares the silent worker dead (when none of
        # the rows left were on it); it does so within the TCP timeout and a little.
        wait_for(
            lambda: address not in client.scheduler_info(n_workers=-1)["workers"],
            12 + 20,
            "the cut worker removed by the scheduler",
        )

        # The cut worker and its nanny end by themselves: nothing waits on them for ever.
        wait_for(lambda: all(p.poll() is not None for p in victim.processes), 60, "exit")
        victim.restore()
        victim.processes.clear()
        again = start_workers(client, cluster.scheduler_address, [victim])[victim.name]
        wait_ready(client, CONTEXT, [again], 60)
    rows = read_predictions(output)
    assert len(rows) == 1500 and not rows.duplicated(["claim_id", "template"]).any()
    assert result.report["units"]["total"] == result.report["units"]["computed"]
    # The run waited for the silent worker's tasks at most the TCP timeout and a little.
    assert finished < 12 + 20, finished


CLIENT = Path(__file__).with_name("fever_client.py")


def test_the_clients_link_cut_for_30_s_mid_run_never_hangs_and_no_row_is_lost_or_doubled(
    network, tiny_model_dir, tmp_path
):
    """The client runs in a host of its own. Once the workers have scored some units, its
    frames are dropped at the bridge for 30 s, then let through again. The run either
    completes with every row once, or fails with a clear error and a rerun resumes from its
    output; it never hangs."""
    settings = {"pcm.cache-directory": str(tmp_path / "cache")}
    data, output = _claims(tmp_path / "claims.jsonl", 1500), tmp_path / "preds"
    hosts = [network.add_host(link=100) for _ in range(2)]
    user = network.add_host(link=100)
    with cluster_on(network, settings) as (cluster, client):
        workers = start_workers(client, cluster.scheduler_address, hosts)
        argv = [sys.executable, str(CLIENT), cluster.scheduler_address, str(data)]
        argv += [str(tiny_model_dir), str(output)]
        run = user.popen(argv, log="client")
        wait_for(
            lambda: (
                sum(_tasks_on(client, w) for w in workers.values()) >= 4 or run.poll() is not None
            ),
            90,
            "units scored",
        )
        assert run.poll() is None, user.log("client")
        with user.cut_off():
            time.sleep(30)  # the fault itself: a link down for 30 s
        code = run.wait(120)
        log = user.log("client")
        if code:
            # A clear error naming what was lost, then a rerun that resumes.
            error = log.strip().splitlines()[-1]
            assert error.startswith("ERROR "), log[-3000:]
            assert "scheduler" in error.lower(), error
            again = user.popen(argv, log="rerun")
            assert again.wait(120) == 0, user.log("rerun")[-3000:]
            units = json.loads(user.log("rerun").strip().splitlines()[-1])
            assert units["reused"] > 0, units
        else:
            units = json.loads(log.strip().splitlines()[-1])
    rows = read_predictions(output)
    assert len(rows) == 1500 and not rows.duplicated(["claim_id", "template"]).any()
    assert units["failed"] == 0, units
