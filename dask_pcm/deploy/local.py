"""Clusters that dask_pcm starts on this machine, their workers set up as every dask_pcm
worker is (:mod:`dask_pcm.deploy.worker_setup`).

:class:`Nanny` is distributed's nanny with the dask_pcm worker setup as a nanny preload: its
worker process has no ``MALLOC_TRIM_THRESHOLD_``, a coarser profiler and event-loop tick,
a template folder shared by the workers of the host, torch and transformers imported as it
starts, the preemption plugin, and on a host with GPUs one GPU of its own.
:func:`local_cluster` starts its workers with it, one per GPU where there are GPUs, and gives
its scheduler and nannies the coarser tick too (``pcm.tick-interval``): in a local run the
client's process hosts the scheduler and the nannies, whose wake-ups take time from the
workers they share the cores with.

Workers started by hand get the same setup from ``dask-pcm worker SCHEDULER_ADDRESS``
(:mod:`dask_pcm.cli.worker`), which takes every option of ``dask worker``.
"""

from __future__ import annotations

import os
from typing import Any

import dask.config
import distributed
from distributed import LocalCluster

from dask_pcm.deploy import forkserver, with_preload, worker_setup
from dask_pcm.gpus import visible_gpus


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
    >>> cluster = LocalCluster(worker_class=dask_pcm.Nanny)   # doctest: +SKIP
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["preload_nanny"] = worker_setup.with_nanny_preload(kwargs.get("preload_nanny"))
        # The nanny reads the tick as it starts; the worker's comes from the preload.
        with dask.config.set(worker_setup.tick_config()):
            super().__init__(*args, **kwargs)


def local_cluster(
    n_workers: int | None = None, threads_per_worker: int = 1, **kwargs: Any
) -> LocalCluster:
    """A :class:`distributed.LocalCluster` of processes that use :class:`Nanny`.

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
