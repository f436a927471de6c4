"""Clusters that dask_pcm starts: worker processes without the nanny's malloc penalty and
with a coarser profiler, the process-wide config left as it was."""

from __future__ import annotations

import os

import dask.config
import pytest
from distributed import Client, LocalCluster

import dask_pcm


def _env() -> tuple[str | None, str | None]:
    return os.environ.get("MALLOC_TRIM_THRESHOLD_"), os.environ.get("OMP_NUM_THREADS")


def _profile_interval() -> str:
    return dask.config.get("distributed.worker.profile.interval")


def test_local_cluster_workers_do_not_trim_malloc():
    # A plain distributed cluster first: it shows the penalty exists, and its nanny leaks the
    # variable into this process's environment, which dask_pcm's nanny must not pass on.
    with LocalCluster(n_workers=1, dashboard_address=":0") as plain, Client(plain) as client:
        assert set(client.run(_env).values()) == {("65536", "1")}
        assert set(client.run(_profile_interval).values()) == {"10ms"}
    with dask_pcm.local_cluster(n_workers=2, dashboard_address=":0") as lc, Client(lc) as client:
        assert list(client.run(_env).values()) == [(None, "1"), (None, "1")]
        assert set(client.run(_profile_interval).values()) == {"100ms"}
        lc.scale(3)  # workers added later use the same nanny
        client.wait_for_workers(3)
        assert set(client.run(_env).values()) == {(None, "1")}
    assert dask.config.get("distributed.worker.profile.interval") == "10ms"


def _tick(dask_worker=None, dask_scheduler=None) -> float:
    return (dask_worker or dask_scheduler)._tick_interval


def test_local_cluster_processes_check_their_event_loop_less_often():
    """distributed checks every 20 ms; in a local run the scheduler and nannies share the
    client's process, and their wake-ups took about 1 % of the cores the workers use."""
    with dask_pcm.local_cluster(n_workers=1, dashboard_address=":0") as lc, Client(lc) as client:
        assert client.run_on_scheduler(_tick) == 0.1
        assert set(client.run(_tick).values()) == {0.1}
        assert [n._tick_interval for n in lc.workers.values()] == [0.1]
    with (
        dask.config.set({"pcm.tick-interval": None}),
        dask_pcm.local_cluster(n_workers=1, dashboard_address=":0") as lc,
        Client(lc) as client,
    ):
        assert client.run_on_scheduler(_tick) == 0.02  # distributed's own
        assert set(client.run(_tick).values()) == {0.02}
    assert dask.config.get("distributed.admin.tick.interval") == "20ms"


def _tokens(prompt: str) -> list[int]:
    lm = dask_pcm.get_context("tiny")
    return lm.tokenizer(prompt)["input_ids"]


def test_full_level_across_worker_processes(tiny_model_dir):
    with dask_pcm.local_cluster(n_workers=2, dashboard_address=":0") as lc, Client(lc) as client:
        dask_pcm.register(client, dask_pcm.causal_lm(tiny_model_dir, name="tiny"))
        out = client.gather(
            dask_pcm.map(client, _tokens, ["a b", "c d", "e f", "g h"], context="tiny")
        )
        assert all(isinstance(t, list) and t for t in out)
        table = dask_pcm.status(client)
        assert list(table["loads"]) == [1, 1]
        assert table["tasks"].sum() == 4


def test_a_worker_killed_while_its_context_loads_does_not_fail_register():
    """register() used to raise ContextLoadError ("worker unreachable") when a worker left
    while the context loaded: on an opportunistic cluster, a preemption during start-up
    ended the run (seen in the SLURM soak). The context is ready on the others; a worker
    that joins later builds it."""
    import os
    import signal
    import threading
    import time
    from functools import partial

    from dask_pcm.testing.tasks import slow_loader

    with (
        dask_pcm.local_cluster(n_workers=2, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        client.wait_for_workers(2)
        victim, survivor = sorted(client.scheduler_info()["workers"])
        pid = client.run(os.getpid, workers=[victim])[victim]
        killer = threading.Timer(1.5, os.kill, (pid, signal.SIGKILL))  # mid-load
        killer.start()
        context = dask_pcm.Context("slow", partial(slow_loader, seconds=4.0))
        start = time.monotonic()
        table = dask_pcm.register(client, context)
        killer.join()
        assert time.monotonic() - start < 60
        ready = table[table["state"] == "ready"]
        assert survivor in set(ready["worker"]) and victim not in set(table["worker"])


def _preimported() -> list[str]:
    """On a worker: the heavy modules imported once its preimport thread is done."""
    import sys
    import threading

    for thread in threading.enumerate():
        if thread.name == "dask-pcm-preimport":
            thread.join(timeout=120)
    return [name for name in ("torch", "transformers") if name in sys.modules]


def _copies(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))


def test_workers_of_one_host_share_one_template_copy_and_import_torch_as_they_start(
    tiny_model_dir, tmp_path
):
    """Each worker used to copy the template into its own folder (538 MB, 2.4 s each for the
    embedded model) and to import torch and transformers only when the context arrived."""
    from dask_pcm.templates.manifest import build_manifest

    shared = tmp_path / "dask-scratch-space" / "pcm-templates"
    with (
        dask.config.set({"temporary-directory": str(tmp_path)}),
        dask_pcm.local_cluster(n_workers=2, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        client.wait_for_workers(2)
        # No context yet: the workers imported torch and transformers on their own.
        assert list(client.run(_preimported).values()) == [["torch", "transformers"]] * 2
        table = dask_pcm.register(client, dask_pcm.causal_lm(tiny_model_dir, name="tiny"))
        assert list(table["state"]) == ["ready", "ready"]
        assert table["location"].nunique() == 1
        assert _copies(shared) == [os.path.basename(table["location"].iloc[0])]
        fetched = sorted(table["bytes_from_source"] + table["bytes_from_peers"])
        assert fetched == [0, build_manifest(tiny_model_dir)[0].total_bytes]  # one copy made
    assert _copies(shared) == []  # removed by its last user, as the workers' own folders are


def _process() -> dict:
    """On a worker: who started its process, and what a spawned worker would have."""
    import sys

    import torch

    return {
        "parent": os.getppid(),
        "threads": torch.get_num_threads(),
        "malloc_trim": os.environ.get("MALLOC_TRIM_THRESHOLD_"),
        "hash": hash("dask_pcm"),  # PYTHONHASHSEED: workers of one cluster hash alike
        "marker": os.environ.get("PCM_TEST_SET_AFTER_SERVER"),
        "modeling_utils": "transformers.modeling_utils" in sys.modules,
    }


def test_local_cluster_forks_its_workers_from_one_process_that_imported_torch(monkeypatch):
    """Every worker process used to import torch and transformers by itself as it started,
    the workers of a host at once on the cores they share. Forked workers must look like
    spawned ones: one torch thread, no malloc trim, the nanny's hash seed, and the
    environment this process has now, not the one the server started with."""
    with dask_pcm.local_cluster(n_workers=2, dashboard_address=":0") as lc, Client(lc) as client:
        forked = list(client.run(_process).values())
        monkeypatch.setenv("PCM_TEST_SET_AFTER_SERVER", "seen")  # after the server started
        lc.scale(3)  # added later: spawned
        client.wait_for_workers(3)
        everyone = list(client.run(_process).values())
    with (
        dask.config.set({"pcm.worker.fork-server": False}),
        dask_pcm.local_cluster(n_workers=1, dashboard_address=":0") as lc,
        Client(lc) as client,
    ):
        spawned = list(client.run(_process).values())
    with dask_pcm.local_cluster(n_workers=1, dashboard_address=":0") as lc, Client(lc) as client:
        forked_later = list(client.run(_process).values())
    # Forked: by one server (not this process), with what from_pretrained needs imported.
    assert len({w["parent"] for w in forked}) == 1
    assert forked[0]["parent"] != os.getpid()
    assert all(w["modeling_utils"] for w in forked)
    assert forked_later[0]["parent"] == forked[0]["parent"]  # the same server, still up
    assert forked_later[0]["marker"] == "seen"
    assert spawned[0]["parent"] == os.getpid()
    assert sorted(w["parent"] for w in everyone).count(os.getpid()) == 1
    for w in [*everyone, *spawned, *forked_later]:
        assert (w["threads"], w["malloc_trim"], w["hash"]) == (1, None, spawned[0]["hash"])
    assert dask.config.get("distributed.worker.multiprocessing-method") == "spawn"


def _gone(client: Client, address: str, timeout: float = 30) -> None:
    import time

    deadline = time.monotonic() + timeout
    while address in client.scheduler_info()["workers"]:
        assert time.monotonic() < deadline, f"{address} still listed after {timeout} s"
        time.sleep(0.1)


def test_a_nanny_restarting_its_worker_is_kept_past_lost_worker_timeout():
    """distributed closed the nanny of a worker gone for lost-worker-timeout (15 s) even
    while it restarted the worker: a restarted worker is spawned and imports torch again,
    which on a busy CI host took longer, and a run waited for ever with no worker left.
    Here the timeout is shorter than any restart."""
    import signal

    with (
        dask.config.set({"distributed.deploy.lost-worker-timeout": "0.2s"}),
        dask_pcm.local_cluster(n_workers=1, dashboard_address=":0") as lc,
        Client(lc) as client,
    ):
        client.wait_for_workers(1)
        (address,) = client.scheduler_info()["workers"]
        pid = client.run(os.getpid)[address]
        os.kill(pid, signal.SIGKILL)
        _gone(client, address)
        client.wait_for_workers(1, timeout=90)
        assert client.submit(len, "abc").result(timeout=30) == 3
        assert pid not in client.run(os.getpid).values()
        assert list(lc.workers) == [0]


def _length(rows):
    return [{"n": len(r["text"])} for r in rows]


def test_a_run_on_a_local_cluster_that_cannot_get_a_worker_raises_instead_of_waiting():
    """With no worker and no nanny to bring one (started with none; or a nanny that closed,
    as one does when its worker cannot start again), a run used to wait for ever."""
    rows = [{"id": i, "text": "x" * i} for i in range(4)]
    with dask.config.set({"pcm.jobs.start-timeout": "2s"}):
        with dask_pcm.local_cluster(n_workers=0, dashboard_address=":0") as lc, Client(lc):
            with pytest.raises(dask_pcm.NoWorkerError, match="no worker process") as info:
                dask_pcm.run_batch(_length, rows, cluster=lc, progress=False)
            assert lc.scheduler_address in str(info.value)
            lc.scale(1)  # as the message says: a worker comes, and the same run goes through
            result = dask_pcm.run_batch(_length, rows, cluster=lc, progress=False)
            assert list(result.to_pandas().sort_values("id")["n"]) == [0, 1, 2, 3]
        with (
            dask.config.set({"distributed.deploy.lost-worker-timeout": "60s"}),
            dask_pcm.local_cluster(n_workers=1, dashboard_address=":0") as lc,
            Client(lc) as client,
        ):
            client.wait_for_workers(1)
            client.sync(lc.workers[0].close)  # as a nanny whose worker cannot start again
            stopped = r"its workers 0 \(closed\) have stopped"
            with pytest.raises(dask_pcm.NoWorkerError, match=stopped):
                dask_pcm.run_batch(_length, rows, cluster=lc, progress=False)


def test_a_run_on_a_users_local_cluster_whose_nannies_were_closed_raises():
    """On a plain distributed.LocalCluster, distributed itself closes the nanny of a worker
    gone for lost-worker-timeout, even mid-restart, and then waits: a run on it used to
    wait for ever with no worker (the CI hang, on a cluster that is not dask_pcm's)."""
    import signal

    rows = [{"id": i, "text": "x" * i} for i in range(4)]
    timeouts = {"pcm.jobs.start-timeout": "2s", "distributed.deploy.lost-worker-timeout": "0.2s"}
    with (
        dask.config.set(timeouts),
        LocalCluster(n_workers=1, threads_per_worker=1, dashboard_address=":0") as lc,
        Client(lc) as client,
    ):
        client.wait_for_workers(1)
        (address,) = client.scheduler_info()["workers"]
        os.kill(client.run(os.getpid)[address], signal.SIGKILL)
        _gone(client, address)
        with pytest.raises(dask_pcm.NoWorkerError, match="LocalCluster at tcp://"):
            dask_pcm.run_batch(_length, rows, cluster=client, progress=False)
