"""Batch jobs whose worker left while the batch system still holds them: kept, not killed.

distributed's ``SpecCluster`` closes a worker's job ``distributed.deploy.lost-worker-timeout``
(15 s) after the worker left, unless a worker of that name came back meanwhile; for a batch
job that close is a ``scancel`` or ``qdel``. A job that SLURM or Grid Engine requeued
(``scontrol requeue``, preemption with requeue, ``qmod -rj``) waits in the queue and then
starts again from the top, its worker joining under the same name: killing it at 15 s and
submitting a replacement (the watchdog's :meth:`~dask_pcm.deploy.jobwatch.JobWatch.check_jobs`
reopens the emptied slot) throws away its place in the queue and submits a job more. Seen
when a requeued job took longer than 15 s to start again on a slow host.

:class:`KeepsQueuedJobs` makes that close look at the queue first: a job the batch system
still lists (pending, requeued, running while its worker starts) is kept, however long it
waits, as the watchdog keeps jobs waiting for their first start; one that left the queue is
closed as before, and the watchdog replaces it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

import dask.config
from dask.utils import parse_timedelta
from distributed.deploy.spec import SpecCluster

from dask_pcm.deploy.jobwatch import in_queue, queued_job_ids

logger = logging.getLogger(__name__)


class KeepsQueuedJobs:
    """Cluster mixin (before the dask-jobqueue cluster class): a lost worker's job is closed
    only once it has left the batch queue."""

    if TYPE_CHECKING:
        kind: str
        workers: dict[str, Any]
        scheduler_info: dict[str, Any]
        _futures: set[Any]

    def _update_worker_status(self, op: str, msg: Any) -> None:
        if op != "remove":
            super()._update_worker_status(op, msg)  # type: ignore[misc]
            return
        name = self.scheduler_info["workers"][msg]["name"]
        delay = parse_timedelta(dask.config.get("distributed.deploy.lost-worker-timeout"))

        def later() -> None:
            self._futures.add(asyncio.ensure_future(self._close_lost(name, msg)))

        asyncio.get_running_loop().call_later(delay, later)
        # What comes after SpecCluster's own handler (which would close the job unasked).
        super(SpecCluster, self)._update_worker_status(op, msg)  # type: ignore[misc]

    async def _close_lost(self, name: Any, address: str) -> None:
        """Close the job of worker ``name`` (that left from ``address``) unless a worker of
        that name is back or the batch system still lists the job."""
        workers = self.scheduler_info["workers"]
        if name not in self.workers or address in workers:
            return
        if any(w.get("name") == name for w in workers.values()):
            return  # back: a requeued job's worker rejoins under its name
        job_id = getattr(self.workers[name], "job_id", None)
        if job_id:
            queued = await asyncio.to_thread(queued_job_ids, self.kind)
            if queued is None or in_queue(job_id, queued):
                logger.info(
                    "Worker %s left; its batch job %s is still queued (requeued, or starting "
                    "again): kept",
                    name,
                    job_id,
                )
                return
        job = self.workers.pop(name, None)
        if job is not None:
            await job.close()
