"""Where workers come from: local clusters, Grid Engine, SLURM and HTCondor jobs (through
dask-jobqueue), ``dask-pcm worker``, the setup all their workers get
(:mod:`dask_pcm.deploy.worker_setup`), and how a worker leaves when its job is preempted."""

from __future__ import annotations

from typing import Any

import dask.config

#: The scheduler preload that the clusters of :mod:`dask_pcm.deploy` give their schedulers
#: (:mod:`dask_pcm.scheduler.preload`). Named, not imported: importing it builds the
#: dashboard page (Bokeh), which every worker would pay for on its first dask_pcm task.
SCHEDULER_PRELOAD = "dask_pcm.scheduler.preload"

#: The batch systems :func:`batch_cluster` starts workers on. Here, not in
#: :mod:`dask_pcm.deploy.jobqueue`, so that naming them does not import dask-jobqueue (whose
#: ``runner`` module replaces the process's SIGINT handler when imported).
KINDS = ("sge", "htcondor", "slurm")


def with_preload(preload: Any) -> list[str]:
    """``preload`` (a scheduler's ``preload`` argument: ``None``, a name or a list) with
    :data:`SCHEDULER_PRELOAD` added; ``None`` stands for ``distributed.scheduler.preload``
    from the config."""
    if preload is None:
        preload = dask.config.get("distributed.scheduler.preload") or []
    names = [preload] if isinstance(preload, str) else list(preload)
    return names if SCHEDULER_PRELOAD in names else [*names, SCHEDULER_PRELOAD]
