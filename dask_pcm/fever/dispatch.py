"""Sending a FEVER run's units to the cluster, and their rows to the output as they return.

Three things keep a run of 90,910 units cheap on the client, the scheduler and per unit:

- **Packed tasks.** One task scores several consecutive units of one template
  (:func:`~dask_pcm.fever.units.score_units`), as many as take about ``pcm.fever.task-seconds``
  by the scoring time the tasks report (one unit per task until the first returns, 64 at
  most). With a small model, a unit of 16 claims takes milliseconds, about what Dask spends
  on a task (messages, transitions, the result's trip back); packing keeps that cost a small
  part of the work on fast GPUs and slow CPUs alike. Units stay the grain of the output and
  of a resume. Near the end, tasks shrink so that every worker thread gets a share.
- **Waves.** At most ``pcm.fever.tasks-in-flight`` tasks (default 4 per worker thread, at
  least 64) are submitted and not yet returned; the rest of the units wait on the client as
  plain objects. The scheduler never holds the whole grid, and a finished task's result is
  written and released before the next is sent.
- **Batched results.** Finished tasks are gathered together, in one request per batch, and
  their rows come back as Arrow tables.

Tasks run in submission order (each wave has a lower priority than the last). A task whose
workers were lost allowed-failures times over (:class:`~distributed.scheduler.KilledWorker`,
likely preemption on an opportunistic cluster) is submitted again twice before the run
fails.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from distributed import Client, Future, as_completed
from distributed.scheduler import KilledWorker

from dask_pcm import client as pcm
from dask_pcm import config
from dask_pcm.fever import units as fever_units
from dask_pcm.fever.units import CONTEXT, Unit

if TYPE_CHECKING:
    import pyarrow as pa

logger = logging.getLogger(__name__)

#: Units one task scores at most.
MAX_UNITS_PER_TASK = 64
#: Tasks in flight at least, whatever the cluster's size: enough queued work for an adaptive
#: cluster to ask for more workers.
MIN_IN_FLIGHT = 64
# Times a task lost with its workers is submitted again.
_RETRIES = 2
# Seconds between asking the scheduler how many worker threads there are.
_THREADS_EVERY = 2.0


@dataclass
class _Task:
    units: list[Unit]
    tries: int = 0


class Dispatch:
    """Score ``todo`` on ``client``; ``on_unit(name, table)`` receives each finished unit.

    Parameters
    ----------
    client
        A client whose cluster has the :data:`~dask_pcm.fever.units.CONTEXT` registered.
    todo
        The units, in the order they should run (consecutive units of one template are
        packed together).
    options
        Keyword arguments of :func:`~dask_pcm.fever.units.score_units` (``method``,
        ``prefix_cache``).
    progress
        Called with the number of units just finished.
    in_flight
        Tasks in flight at most; default ``pcm.fever.tasks-in-flight``.
    """

    def __init__(
        self,
        client: Client,
        todo: list[Unit],
        options: dict[str, Any],
        on_unit: Callable[[str, pa.Table], None],
        progress: Callable[[int], None] = lambda n: None,
        in_flight: int | None = None,
    ) -> None:
        self.client = client
        self.queue = deque(todo)
        self.options = options
        self.on_unit = on_unit
        self.progress = progress
        configured = in_flight or config.get("fever.tasks-in-flight")
        self._fixed_in_flight = int(configured) if configured else None
        self.task_seconds = config.fever_task_seconds()
        self.unit_seconds: float | None = None
        self.tasks = 0  # submitted, resubmissions included
        self._waves = 0
        self._threads = 1
        self._threads_at = -_THREADS_EVERY
        self._running: dict[Future, _Task] = {}

    # -- sizing -----------------------------------------------------------------------------
    def threads(self) -> int:
        """Worker threads in the cluster now (asked every few seconds; at least 1)."""
        now = time.monotonic()
        if now - self._threads_at >= _THREADS_EVERY:
            self._threads = max(1, sum(self.client.nthreads().values()))
            self._threads_at = now
        return self._threads

    def in_flight(self) -> int:
        if self._fixed_in_flight:
            return self._fixed_in_flight
        return max(4 * self.threads(), MIN_IN_FLIGHT)

    def units_per_task(self) -> int:
        """Units for the next task: about ``task_seconds`` of work, 1 until a task has
        reported, fewer near the end so that every worker thread gets some."""
        if self.unit_seconds is None:
            return 1
        wanted = int(self.task_seconds / max(self.unit_seconds, 1e-6))
        share = len(self.queue) // (2 * self.threads())
        return max(1, min(wanted, share, MAX_UNITS_PER_TASK))

    def _learn(self, seconds: float, units: int) -> None:
        per_unit = seconds / max(units, 1)
        old = self.unit_seconds
        self.unit_seconds = per_unit if old is None else 0.7 * old + 0.3 * per_unit

    # -- submitting -------------------------------------------------------------------------
    def _next_tasks(self) -> list[_Task]:
        tasks: list[_Task] = []
        while self.queue and len(self._running) + len(tasks) < self.in_flight():
            size = self.units_per_task()
            first = self.queue.popleft()
            pack = [first]
            while self.queue and len(pack) < size and self.queue[0].template is first.template:
                pack.append(self.queue.popleft())
            tasks.append(_Task(pack))
        return tasks

    def _submit(self, tasks: list[_Task]) -> list[Future]:
        if not tasks:
            return []
        self._waves += 1
        futures = pcm.map(
            self.client,
            fever_units.score_units,
            [t.units[0].template for t in tasks],
            [[(u.name, list(u.claims)) for u in t.units] for t in tasks],
            context=CONTEXT,
            key=[f"fever-{t.units[0].name}-x{len(t.units)}-{os.urandom(4).hex()}" for t in tasks],
            priority=-self._waves,  # earlier waves first
            pure=False,
            **self.options,
        )
        self.tasks += len(tasks)
        self._running.update(zip(futures, tasks, strict=True))
        return futures

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> None:
        """Submit, collect and hand over every unit; on any error the tasks still running
        are cancelled and the error raised."""
        try:
            queue = as_completed(self._submit(self._next_tasks()))
            for batch in queue.batches():
                self._collect(batch, queue)
                queue.update(self._submit(self._next_tasks()))
        except BaseException:
            self.client.cancel(list(self._running))
            self._running.clear()
            raise

    def _collect(self, batch: list[Future], queue: as_completed) -> None:
        finished = [f for f in batch if f.status == "finished"]
        for future in batch:
            if future.status != "finished":
                queue.update(self._failed(future))
        results = self.client.gather(finished) if finished else []
        for future, result in zip(finished, results, strict=True):
            task = self._running.pop(future)
            self._learn(result["seconds"], len(task.units))
            for name, table in result["units"]:
                self.on_unit(name, table)
            self.progress(len(task.units))

    def _failed(self, future: Future) -> list[Future]:
        """Submit again a task lost with its workers; raise anything else."""
        task = self._running.pop(future)
        if future.status != "error":
            raise RuntimeError(f"task {future.key} ended as {future.status!r}, not finished")
        error = future.exception()
        # Workers preempted while running the same task, distributed's allowed-failures
        # times over: on an opportunistic cluster that is bad luck more often than a task
        # that kills workers, so try it again a few times before giving up.
        if not isinstance(error, KilledWorker) or task.tries >= _RETRIES:
            raise error
        logger.warning(
            "Units %s..%s lost with their workers (%s); submitting them again",
            task.units[0].name,
            task.units[-1].name,
            error,
        )
        task.tries += 1
        return self._submit([task])
