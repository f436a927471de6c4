"""One GPU per worker process: each nanny gives its worker its own CUDA_VISIBLE_DEVICES.

No GPU is needed: what a worker may see is what CUDA_VISIBLE_DEVICES lists, and these tests
set it for the cluster's parent process as a batch system would for a job.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections import Counter
from types import SimpleNamespace

import dask.config
import pytest
from distributed import Client, LocalCluster

import dask_pcm
from dask_pcm.deploy import gpu, jobqueue, worker_setup
from dask_pcm.locks import unlock


def _visible() -> str | None:
    return os.environ.get("CUDA_VISIBLE_DEVICES")


@pytest.fixture
def own_locks(tmp_path):
    with dask.config.set({"pcm.lock-directory": str(tmp_path / "locks")}):
        yield tmp_path / "locks"


def test_claims_go_to_the_least_shared_gpu_and_come_back(own_locks):
    first = gpu.claim_gpu(["2", "5"], "a")
    second = gpu.claim_gpu(["2", "5"], "b")
    third = gpu.claim_gpu(["2", "5"], "c")
    assert [(c.entry, c.slot) for c in (first, second, third)] == [("2", 0), ("5", 0), ("2", 1)]
    unlock(second.fd)
    again = gpu.claim_gpu(["2", "5"], "d")
    assert (again.entry, again.slot) == ("5", 0)
    assert gpu.claim_gpu([], "e") is None
    for claim in (first, third, again):
        unlock(claim.fd)


def test_local_cluster_starts_one_worker_per_gpu_each_on_its_own(monkeypatch, own_locks, caplog):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with dask_pcm.local_cluster(dashboard_address=":0") as cluster, Client(cluster) as client:
        assert sorted(client.run(_visible).values()) == ["0", "1"]
        with caplog.at_level(logging.WARNING, logger="dask_pcm.deploy.gpu"):
            cluster.scale(3)  # more workers than GPUs: the third shares, and says so
            client.wait_for_workers(3)
        assert sorted(Counter(client.run(_visible).values()).values()) == [1, 2]
        assert "shared by 2 workers" in caplog.text
        cluster.scale(1)
        deadline = time.monotonic() + 30
        while len(client.scheduler_info()["workers"]) > 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        cluster.scale(2)  # the GPUs of the workers that left are free again
        client.wait_for_workers(2)
        assert sorted(client.run(_visible).values()) == ["0", "1"]


def test_without_gpus_nothing_is_bound(monkeypatch, own_locks):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    cluster = dask_pcm.local_cluster(n_workers=2, dashboard_address=":0")
    with cluster, Client(cluster) as client:
        assert list(client.run(_visible).values()) == ["", ""]
    assert not list(own_locks.glob("gpu-*"))


def test_dask_worker_binds_gpus_with_the_nanny_preload(monkeypatch, own_locks):
    # What dask-jobqueue jobs run: `dask worker ... --preload-nanny dask_pcm.deploy.worker_setup`,
    # two worker processes in a job that may see two GPUs.
    assert jobqueue.job_options("sge")["worker_extra_args"][:2] == [
        "--preload-nanny",
        worker_setup.PRELOAD,
    ]
    env = dict(
        os.environ,
        CUDA_VISIBLE_DEVICES="0,1",
        DASK_PCM__LOCK_DIRECTORY=str(own_locks),
    )
    with LocalCluster(n_workers=0, dashboard_address=":0") as cluster, Client(cluster) as client:
        command = [sys.executable, "-m", "distributed.cli.dask_worker", cluster.scheduler_address]
        command += ["--nworkers", "2", "--nthreads", "1", "--preload-nanny", worker_setup.PRELOAD]
        job = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            client.wait_for_workers(2, timeout=60)
            assert sorted(client.run(_visible).values()) == ["0", "1"]
        finally:
            job.terminate()
            job.wait(30)


def test_the_gpu_preload_of_older_job_scripts_still_binds(own_locks):
    """``--preload-nanny dask_pcm.deploy.gpu``, as job scripts written before the worker
    setup name it, binds the GPU alone."""
    nanny = SimpleNamespace(env={"CUDA_VISIBLE_DEVICES": "3"}, name="old")
    gpu.dask_setup(nanny)
    assert nanny.env["CUDA_VISIBLE_DEVICES"] == "3" and list(own_locks.glob("gpu-3.0.lock"))
    gpu.dask_teardown(nanny)
    again = gpu.claim_gpu(["3"], "again")
    assert again.slot == 0  # given back
    unlock(again.fd)
