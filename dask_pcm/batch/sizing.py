"""How a batch run sizes its work: tasks in flight, and units packed into each task.

:class:`Sizing` keeps at most ``pcm.batch.tasks-in-flight`` tasks out (default 4 per worker
thread, at least :data:`MIN_IN_FLIGHT`), and packs about ``pcm.batch.task-seconds`` of work
into a task by the time per unit the tasks report (a moving average): one unit per task until
the first returns, :data:`MAX_UNITS_PER_TASK` at most, fewer near the end so that every
worker thread gets a share.
"""

from __future__ import annotations

import time
from typing import Any

from dask_pcm import config

#: Units one task runs at most.
MAX_UNITS_PER_TASK = 64
#: Tasks in flight at least, whatever the cluster's size: enough queued work for an adaptive
#: cluster to ask for more workers.
MIN_IN_FLIGHT = 64
# Seconds between asking the scheduler how many worker threads there are.
_THREADS_EVERY = 2.0


class Sizing:
    """Tasks in flight and units per task for a run on ``client``'s cluster; ``in_flight``
    fixes the first (default ``pcm.batch.tasks-in-flight``)."""

    def __init__(self, client: Any, in_flight: int | None = None) -> None:
        self.client = client
        configured = in_flight or config.batch("tasks-in-flight")
        self._fixed_in_flight = int(configured) if configured else None
        self.task_seconds = config.batch_seconds("task-seconds") or 0.0
        self.unit_seconds: float | None = None  # measured: a moving average
        self._threads = 1
        self._threads_at = -_THREADS_EVERY

    def threads(self) -> int:
        """Worker threads in the cluster now (asked every few seconds; at least 1)."""
        now = time.monotonic()
        if now - self._threads_at >= _THREADS_EVERY:
            self._threads = max(1, sum(self.client.nthreads().values()))
            self._threads_at = now
        return self._threads

    def in_flight(self) -> int:
        """Tasks to keep submitted and not yet returned."""
        if self._fixed_in_flight:
            return self._fixed_in_flight
        return max(4 * self.threads(), MIN_IN_FLIGHT)

    def units_per_task(self, queued: int) -> int:
        """Units for the next task, ``queued`` units waiting: about ``task_seconds`` of work,
        1 until a task has reported, fewer near the end so that every worker thread gets
        some."""
        if self.unit_seconds is None:
            return 1
        wanted = int(self.task_seconds / max(self.unit_seconds, 1e-6))
        share = queued // (2 * self.threads())
        return max(1, min(wanted, share, MAX_UNITS_PER_TASK))

    def learn(self, seconds: float, units: int) -> None:
        """A task of ``units`` units took ``seconds``."""
        per_unit = seconds / max(units, 1)
        old = self.unit_seconds
        self.unit_seconds = per_unit if old is None else 0.7 * old + 0.3 * per_unit
