"""Clusters that dask_pcm starts on this machine, their workers set up as every dask_pcm
worker is (:mod:`dask_pcm.deploy.worker_setup`).

:class:`Nanny` is distributed's nanny with the dask_pcm worker setup as a nanny preload: its
worker process has no ``MALLOC_TRIM_THRESHOLD_``, a coarser profiler and event-loop tick,
a template folder shared by the workers of the host, torch and transformers imported as it
starts, the preemption plugin, and on a host with GPUs one GPU of its own.
:func:`local_cluster` starts its workers with it, one per GPU where there are GPUs, and gives
its scheduler and nannies the coarser tick too (``pcm.tick-interval``): in a local run the
client's process hosts the scheduler and the nannies, whose wake-ups take time from the
workers they share the cores with. The cluster it returns (:class:`LocalCluster`) leaves a
nanny to restart its worker however long that takes, and says when no worker can come.

Workers started by hand get the same setup from ``dask-pcm worker SCHEDULER_ADDRESS``
(:mod:`dask_pcm.cli.worker`), which takes every option of ``dask worker``.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import dask.config
import distributed
from dask.utils import parse_timedelta
from distributed.core import Status
from distributed.deploy.cluster import Cluster

from dask_pcm import config
from dask_pcm.deploy import forkserver, with_preload, worker_setup
from dask_pcm.exceptions import NoWorkerError
from dask_pcm.gpus import visible_gpus

# A worker object of a cluster (a nanny, a batch job) in one of these states may still
# bring a worker.
_ALIVE = (Status.created, Status.init, Status.starting, Status.running)


class Nanny(distributed.Nanny):
    """A :class:`distributed.Nanny` for inference workers: the dask_pcm worker setup
    (:mod:`dask_pcm.deploy.worker_setup`) as one of its preloads, and its own event loop
    checked every ``pcm.tick-interval`` (default 100ms, distributed's 20ms).

    Its worker has no ``MALLOC_TRIM_THRESHOLD_`` (``pcm.worker.disable-malloc-trim``),
    profiles every ``pcm.worker.profile-interval``, checks its event loop every
    ``pcm.tick-interval``, runs the worker preloads :mod:`dask_pcm.worker.preimport` and
    :mod:`dask_pcm.deploy.preemption`, and on a host with GPUs has one GPU of its own
    (``CUDA_VISIBLE_DEVICES``; ``pcm.worker.gpu-per-worker``).

    Examples
    --------
    >>> cluster = distributed.LocalCluster(worker_class=dask_pcm.Nanny)   # doctest: +SKIP
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["preload_nanny"] = worker_setup.with_nanny_preload(kwargs.get("preload_nanny"))
        # The nanny reads the tick as it starts; the worker's comes from the preload.
        with dask.config.set(worker_setup.tick_config()):
            super().__init__(*args, **kwargs)


class LocalCluster(distributed.LocalCluster):
    """A :class:`distributed.LocalCluster` that keeps a nanny while it restarts its worker,
    and raises (:meth:`raise_if_stuck`) when no worker can come.

    distributed closes the nanny of a worker gone for ``distributed.deploy.lost-worker-timeout``
    (15 s), a rule for a nanny that may have gone with its worker. Here every nanny lives in
    this process, and one still running is restarting its worker: a spawned process that
    imports torch and transformers again, which on a busy host took longer than that. The
    cluster closed both nannies of a two-worker run, and the run waited for ever with no
    worker. A nanny is closed here only once it stopped by itself (it closes when its
    worker cannot start again).
    """

    def _update_worker_status(self, op: str, msg: Any) -> None:
        if op != "remove":
            super()._update_worker_status(op, msg)
            return
        name = self.scheduler_info["workers"][msg]["name"]
        # distributed.SpecCluster's own timer skipped: it closes a nanny that is restarting.
        Cluster._update_worker_status(self, op, msg)
        delay = parse_timedelta(dask.config.get("distributed.deploy.lost-worker-timeout"))
        loop = asyncio.get_running_loop()

        def drop_if_stopped() -> None:
            worker = self.workers.get(name)
            back = any(w["name"] == name for w in self.scheduler_info["workers"].values())
            if worker is None or back:
                return
            if worker.status in _ALIVE:
                loop.call_later(delay, drop_if_stopped)  # still restarting it: look again
                return
            self._futures.add(asyncio.ensure_future(worker.close()))
            del self.workers[name]

        loop.call_later(delay, drop_if_stopped)

    def raise_if_stuck(self) -> None:
        """Raise :class:`~dask_pcm.exceptions.NoWorkerError` if no worker can come.

        That is: no worker is connected, no nanny of the cluster is running (none was
        started, ``n_workers=0``, or each closed because its worker could not start again),
        nothing scales it (``cluster.adapt``), and so for ``pcm.jobs.start-timeout``.
        A nanny that restarts its worker is never stuck, however long that takes.

        Cheap and safe from any thread: ``run_batch`` and ``run_fever`` call it every
        second while they wait, as for a batch cluster.
        """
        watch = self.__dict__.setdefault("_no_worker_watch", NoWorkerWatch())
        watch.check(self)


class NoWorkerWatch:
    """Notes since when a :class:`distributed.SpecCluster` (a local cluster, anyone's) has
    had no worker connected and none that can come, and raises
    :class:`~dask_pcm.exceptions.NoWorkerError` past ``pcm.jobs.start-timeout``.

    None can come when no worker object of the cluster (a nanny, a worker) is running and
    nothing scales it: distributed itself closes the nanny of a worker gone for
    ``distributed.deploy.lost-worker-timeout``, restarting or not, and then waits. A cluster
    with its own ``raise_if_stuck`` (a batch cluster, :class:`LocalCluster`) is asked that
    instead (:func:`dask_pcm.batch.watch.check_cluster`).
    """

    def __init__(self) -> None:
        self.since: float | None = None

    def check(self, cluster: distributed.SpecCluster) -> None:
        """Raise if ``cluster`` has been without a worker, and without a way to get one, for
        ``pcm.jobs.start-timeout``; note when that began. Safe from any thread."""
        adaptive = getattr(cluster, "_adaptive", None)
        scaling = adaptive is not None and getattr(adaptive, "state", "running") in (
            "starting",
            "running",
        )
        workers = list(cluster.workers.items())
        if (
            cluster.scheduler_info.get("workers")
            or scaling
            or any(getattr(w, "status", None) in _ALIVE for _, w in workers)
        ):
            self.since = None
            return
        now = time.monotonic()
        if self.since is None:
            self.since = now
        timeout = config.job_start_timeout()
        waited = now - self.since
        if timeout is None or waited < timeout:
            return
        stopped = ", ".join(f"{name!r} ({_status(w)})" for name, w in workers)
        why = (
            f"its workers {stopped} have stopped, as a nanny does when its worker cannot "
            "start again (the log of the cluster's process says why)"
            if workers
            else "it has no worker process (started with none, or the nannies of its "
            "workers stopped because their workers could not start again)"
        )
        raise NoWorkerError(
            f"No worker is connected to the {type(cluster).__name__} at "
            f"{cluster.scheduler_address}, and none can come: {why}. Scale it "
            f"(cluster.scale(n)) or make it adaptive (cluster.adapt(...)). (No worker for "
            f"{waited:.0f} s; pcm.jobs.start-timeout is {timeout:g} s.)"
        )


def _status(worker: Any) -> str:
    status = getattr(worker, "status", None)
    return getattr(status, "name", str(status))


def local_cluster(
    n_workers: int | None = None, threads_per_worker: int = 1, **kwargs: Any
) -> LocalCluster:
    """A :class:`LocalCluster` (a :class:`distributed.LocalCluster`) of processes that use
    :class:`Nanny`.

    One thread per worker by default: a model forward pass already uses the cores torch
    gives it. On Linux the workers it starts are forked from one process that imported
    torch and transformers once (``pcm.worker.fork-server``, :mod:`dask_pcm.deploy.forkserver`);
    workers added later by ``scale`` or ``adapt``, or restarted by their nanny, are spawned.
    By default one worker per GPU the process may see (``CUDA_VISIBLE_DEVICES``, else every
    GPU the driver lists), each bound to its own GPU; without GPUs one per core.
    ``n_workers=0`` starts none, for ``cluster.scale`` or ``cluster.adapt`` to add later.

    Examples
    --------
    >>> from dask_pcm import local_cluster
    >>> cluster = local_cluster(n_workers=2)               # doctest: +SKIP
    """
    if n_workers is None:
        n_workers = len(visible_gpus()) or max(1, (os.cpu_count() or 1))
    elif n_workers < 0:
        raise ValueError(f"n_workers must be 0 (scale up later) or more, got {n_workers}")
    # The contexts page in the dashboard ("More..."), and /pcm/status from the start.
    scheduler_kwargs = dict(kwargs.pop("scheduler_kwargs", None) or {})
    scheduler_kwargs["preload"] = with_preload(scheduler_kwargs.get("preload"))
    kwargs["scheduler_kwargs"] = scheduler_kwargs
    kwargs.setdefault("worker_class", Nanny)
    kwargs.setdefault("processes", True)
    # Started first: its imports run while the scheduler starts.
    forked = bool(n_workers) and kwargs["processes"] and forkserver.start()
    if forked:
        # A forked worker has the server's environment, frozen when it started; a spawned
        # one has this process's as it is now. The nanny sets these in its worker.
        kwargs["env"] = {**os.environ, **(kwargs.get("env") or {})}
    with (
        dask.config.set(worker_setup.tick_config()),  # the scheduler reads it as it starts
        forkserver.method(forked),  # the nannies read it as they start their workers
    ):
        return LocalCluster(n_workers=n_workers, threads_per_worker=threads_per_worker, **kwargs)
