"""Batch jobs whose worker left while the batch system still holds them: kept, not killed.

distributed's ``SpecCluster`` closes a worker's job ``distributed.deploy.lost-worker-timeout``
(15 s) after the worker left, unless a worker of that name came back meanwhile; for a batch
job that close is a ``scancel`` or ``qdel``. A job that SLURM or Grid Engine requeued
(``scontrol requeue``, preemption with requeue, ``qmod -rj``) waits in the queue and then
starts again from the top, its worker joining under the same name: killing it at 15 s and
submitting a replacement throws away its place in the queue and submits a job more. Seen
when a requeued job took longer than 15 s to start again on a slow host.

:class:`KeepsQueuedJobs` leaves that decision to the job watchdog
(:meth:`~dask_pcm.deploy.jobwatch.JobWatch.check_jobs`), which already compares the queue
with the connected workers every ``watch_interval``: a job the batch system still lists
(pending, requeued, running while its worker starts) is kept, however long it waits, as are
jobs waiting for their first start; one that left the queue while its worker is away is
dropped and replaced under a new name.

How: distributed has no hook for it. ``SpecCluster._update_worker_status`` schedules the
close when the scheduler reports a worker removed, reading the timeout from the config as
it does. The override below runs distributed's method unchanged, all of it, with the
lost-worker timeout set to :data:`NEVER` around that one call, so the close it schedules
never comes; nothing of distributed's is copied or skipped. Tested with distributed 2026.8.0
and 2025.1.0 (``setup.cfg``'s floor), where ``SpecCluster._update_worker_status(op, msg)``
reads ``distributed.deploy.lost-worker-timeout`` when called
(``tests/deploy/test_jobqueue.py::test_a_lost_workers_job_is_kept_while_queued``, which
fails if a release stops doing so). The setting is process-wide for the moment of that call:
another cluster of the process handling a lost worker at that very moment would wait as long.
"""

from __future__ import annotations

from typing import Any

import dask.config

#: The lost-worker timeout while a batch cluster handles a lost worker: longer than any job.
NEVER = "3650d"
LOST_WORKER_TIMEOUT = "distributed.deploy.lost-worker-timeout"


class KeepsQueuedJobs:
    """Cluster mixin (before the dask-jobqueue cluster class, with
    :class:`~dask_pcm.deploy.jobwatch.JobWatch`): a lost worker's job is never closed by
    distributed's timer; the watchdog drops it once it has left the batch queue."""

    def _update_worker_status(self, op: str, msg: Any) -> None:
        if op != "remove":
            super()._update_worker_status(op, msg)  # type: ignore[misc]
            return
        with dask.config.set({LOST_WORKER_TIMEOUT: NEVER}):
            super()._update_worker_status(op, msg)  # type: ignore[misc]
