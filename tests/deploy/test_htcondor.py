"""On a real HTCondor pool (run from a submit node; not available on the project's CI machine):
a FEVER run on HTCondor jobs, and a worker warned by ``condor_rm`` (``kill_sig = SIGUSR2``).

HTCondor's daemons cannot be installed on the CI machine, so these tests skip there; the
submit descriptions are checked with HTCondor's parser in ``test_batch.py``. On a pool::

    PCM_REQUIRE_HTCONDOR=1 python -m pytest -m htcondor tests/deploy/test_htcondor.py

The pool's execute nodes must reach this machine (set ``jobqueue.htcondor.interface`` or
``scheduler-options``) and share its Python environment and this checkout's path.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from distributed import Client

import dask_pcm
from dask_pcm.testing.tasks import noted_square
from tests.conftest import (
    assert_handed_back,
    load_the_victim,
    require_batch_system,
    wait_gone,
)

pytestmark = [pytest.mark.htcondor, pytest.mark.slow]


@pytest.fixture(scope="module", autouse=True)
def pool() -> None:
    require_batch_system("condor_q", "HTCondor pool", "", "PCM_REQUIRE_HTCONDOR")


def _cluster(tmp_path, workers: int):
    return dask_pcm.batch_cluster(
        "htcondor",
        workers=workers,
        cores=1,
        memory="4GB",
        disk="4GB",
        processes=1,
        log_directory=str(tmp_path / "logs"),
        watch_interval="5s",
        scheduler_options={"dashboard_address": ":0"},
    )


def test_cli_runs_fever_on_htcondor_jobs(tmp_path, tiny_model_dir):
    out = tmp_path / "run.json"
    env = dict(
        os.environ,
        DASK_JOBQUEUE__HTCONDOR__CORES="1",
        DASK_JOBQUEUE__HTCONDOR__MEMORY="2GB",
        DASK_JOBQUEUE__HTCONDOR__DISK="2GB",
    )
    cmd = ["dask-pcm", "fever", "--cluster", "htcondor", "--workers", "2"]
    cmd += ["--model", str(tiny_model_dir), "--num-templates", "2", "--claims-per-task", "10"]
    cmd += ["--json", str(out)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())["report"]
    assert report["units"] == {"total": 6, "computed": 6, "reused": 0, "failed": 0, "unfinished": 0}


def test_condor_rm_warns_the_worker_which_hands_its_work_back(tmp_path, tiny_model_dir):
    log = tmp_path / "runs"  # on a shared filesystem, like the checkout

    with _cluster(tmp_path, workers=2) as cluster, Client(cluster) as client:
        client.wait_for_workers(2, timeout=1800)
        dask_pcm.register(client, dask_pcm.causal_lm(tiny_model_dir, name="tiny", device="cpu"))
        victim, other, held, queued = load_the_victim(client, noted_square, log)
        name = client.scheduler_info()["workers"][victim]["name"]
        subprocess.run(["condor_rm", cluster.workers[name].job_id], check=True)
        wait_gone(client, victim, 120)
        assert_handed_back(client, held, queued, other, log)
