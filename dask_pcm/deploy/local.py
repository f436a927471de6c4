"""Clusters that dask_pcm starts, without the nanny's heap-trimming penalty.

distributed's nanny sets ``MALLOC_TRIM_THRESHOLD_=65536`` in every worker process
(``distributed.nanny.pre-spawn-environ``). For CPU torch inference that made tasks about
30 % slower on the reference machine: glibc then returns freed memory to the OS after almost
every forward pass and fixes its mmap threshold, so the next pass page-faults its buffers
in again. :class:`Nanny` drops that variable; every cluster dask_pcm starts uses it.

The same nanny samples the worker's statistical profiler every ``pcm.worker.profile-interval``
(100ms) instead of distributed's 10ms: each sample runs on the worker's event loop and walks
the deep stacks of a forward pass, about 5 % of a core per worker here. The nanny, its worker
and the scheduler of :func:`local_cluster` check their event loop every ``pcm.tick-interval``
(100ms) instead of distributed's 20ms: in a local run the client's process hosts the
scheduler and the nannies, and their 150 wake-ups a second took about 1 % of a core from the
workers it shares the cores with. Unless
``pcm.worker.template-directory`` is set, its worker keeps template copies in
``pcm-templates`` beside the workers' own folders (``dask-scratch-space``), which the
workers of the host share: one copy of a model per host, not one per worker. Its worker
imports ``pcm.worker.preimport-modules`` (torch, transformers) in a thread as it starts
(:mod:`dask_pcm.worker.preimport`), not when its first context arrives.

On a host with GPUs each nanny gives its worker one GPU of its own
(``CUDA_VISIBLE_DEVICES``, :mod:`dask_pcm.deploy.gpu`), and :func:`local_cluster` starts one
worker per GPU.

If you start workers yourself (``dask worker``, dask-jobqueue), set in your Dask config::

    distributed:
      nanny:
        pre-spawn-environ:
          MALLOC_TRIM_THRESHOLD_: null
      worker:
        profile:
          interval: 100ms

and pass ``--preload-nanny dask_pcm.deploy.gpu`` to ``dask worker`` for the GPU binding.
"""

from __future__ import annotations

import os
from typing import Any

import dask.config
import distributed
from distributed import LocalCluster

from dask_pcm import config
from dask_pcm.deploy import gpu, with_preload
from dask_pcm.gpus import visible_gpus

MALLOC_TRIM = "MALLOC_TRIM_THRESHOLD_"
#: The worker preload that starts the heavy imports (named: the nanny does not import it).
PREIMPORT = "dask_pcm.worker.preimport"


class Nanny(distributed.Nanny):
    """A :class:`distributed.Nanny` for inference workers.

    It does not set ``MALLOC_TRIM_THRESHOLD_`` (``pcm.worker.disable-malloc-trim``, default
    true) and gives its worker a coarser profiler interval (``pcm.worker.profile-interval``,
    default 100ms); it and its worker check their event loop every ``pcm.tick-interval``
    (default 100ms, distributed's 20ms). On a host with GPUs it claims one for its worker
    (``CUDA_VISIBLE_DEVICES``; ``pcm.worker.gpu-per-worker``, default true).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # The nanny reads it as it starts, and copies the config its worker gets.
        with dask.config.set(_ticks()):
            super().__init__(*args, **kwargs)
        if config.get("worker.disable-malloc-trim"):
            leaked = self.pre_spawn_env.pop(MALLOC_TRIM, None)
            self.env.pop(MALLOC_TRIM, None)
            # A plain Nanny started earlier in this process writes its pre-spawn variables
            # into os.environ, where our children would inherit them.
            if leaked is not None and os.environ.get(MALLOC_TRIM) == leaked:
                os.environ.pop(MALLOC_TRIM)
        interval = config.get("worker.profile-interval")
        if interval is not None:
            # dask.config.merge copies nested dicts: the process-wide config stays untouched.
            self.config = dask.config.merge(
                self.config, {"distributed": {"worker": {"profile": {"interval": interval}}}}
            )
        preloads = [self.preload] if isinstance(self.preload, str) else list(self.preload or [])
        if PREIMPORT not in preloads:
            self.preload = [*preloads, PREIMPORT]
        if not config.get("worker.template-directory"):
            shared = os.path.join(self._workspace.base_dir, "pcm-templates")
            self.config = dask.config.merge(
                self.config, {"pcm": {"worker": {"template-directory": shared}}}
            )

    async def start_unsafe(self) -> Any:
        gpu.bind(self)  # before the worker process is spawned with self.env
        try:
            return await super().start_unsafe()
        except BaseException:
            gpu.unbind(self)
            raise

    async def close(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().close(*args, **kwargs)
        finally:
            gpu.unbind(self)


def local_cluster(
    n_workers: int | None = None, threads_per_worker: int = 1, **kwargs: Any
) -> LocalCluster:
    """A :class:`distributed.LocalCluster` of processes that use :class:`Nanny`.

    One thread per worker by default: a model forward pass already uses the cores torch
    gives it. By default one worker per GPU the process may see (``CUDA_VISIBLE_DEVICES``,
    else every GPU the driver lists), each bound to its own GPU; without GPUs one per core.
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
    with dask.config.set(_ticks()):  # the scheduler reads it as it starts
        return LocalCluster(n_workers=n_workers, threads_per_worker=threads_per_worker, **kwargs)


def _ticks() -> dict[str, Any]:
    """``pcm.tick-interval`` as the distributed setting, for a process starting now; empty
    when null (distributed's own)."""
    tick = config.get("tick-interval")
    return {} if tick is None else {"distributed.admin.tick.interval": tick}
