"""Graceful preemption: a worker told it will be killed hands its work back first.

Batch systems warn a job before they kill it: Grid Engine sends ``SIGUSR2`` to a job submitted
with ``qsub -notify`` some seconds (the queue's ``notify`` time) before the ``SIGKILL`` of a
``qdel`` or a preemption; HTCondor sends the job's ``kill_sig`` (``SIGUSR2`` in dask_pcm's
HTCondor template) and waits ``job_max_vacate_time`` before it kills. :class:`GracefulPreemption`
is a worker plugin that turns those signals (``pcm.worker.preemption-signals``) into
:meth:`distributed.Worker.close_gracefully`: the scheduler stops sending the worker tasks,
moves the results it holds to other workers, and gives its queued tasks to others; the worker
then leaves. A worker killed without warning (``SIGKILL``, ``qdel`` without ``-notify``) loses
the tasks it was running, which the scheduler runs again elsewhere; either way no result is lost.

The handler needs the worker's event loop to run in its process's main thread, as in a
``dask worker`` process or a nanny's worker process; in-process workers (threads) are left alone.
By default the signals kill a process, so the job script must ignore them in every other process
of the job (the shell, the nanny): ``trap '' USR2`` before the worker command, as
:func:`dask_pcm.batch_cluster` writes it. Ignored signals stay ignored across ``exec``; the
plugin installs its own handler in the worker process only.

Every dask_pcm worker installs the plugin itself as it starts, through the worker preload
this module is (``--preload dask_pcm.deploy.preemption``), which the dask_pcm worker setup
(:mod:`dask_pcm.deploy.worker_setup`) adds: batch jobs, ``dask-pcm worker`` and
:func:`dask_pcm.local_cluster` alike. Where no batch system sends the signal, the handler
only waits.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from typing import TYPE_CHECKING, Any

from dask.utils import parse_timedelta
from distributed import WorkerPlugin
from distributed.core import Status

from dask_pcm import config

if TYPE_CHECKING:
    from distributed import Worker

logger = logging.getLogger(__name__)

NAME = "dask-pcm-preemption"
#: The worker preload that installs :class:`GracefulPreemption` (``dask worker --preload``).
PRELOAD = "dask_pcm.deploy.preemption"


def preemption_signals() -> list[signal.Signals]:
    """``pcm.worker.preemption-signals`` as signal objects; a clear error for a bad name."""
    names = config.get("worker.preemption-signals") or []
    if isinstance(names, str):
        names = [names]
    out = []
    for name in names:
        key = str(name).upper()
        key = key if key.startswith("SIG") else f"SIG{key}"
        try:
            out.append(signal.Signals[key])
        except KeyError:
            raise ValueError(
                f"pcm.worker.preemption-signals: {name!r} is not a signal name "
                "(e.g. SIGUSR2, SIGTERM)"
            ) from None
    return out


class GracefulPreemption(WorkerPlugin):
    """On a preemption warning signal, retire the worker gracefully (see the module doc)."""

    name = NAME
    idempotent = True

    def __init__(self) -> None:
        self.signals = [int(s) for s in preemption_signals()]
        self.received: int | None = None

    def setup(self, worker: Worker) -> None:
        self.worker = worker
        if threading.current_thread() is not threading.main_thread():
            logger.debug("%s: worker loop not in the main thread; no signal handlers", NAME)
            return
        loop = asyncio.get_running_loop()
        for signum in self.signals:
            loop.add_signal_handler(signum, self._warned, signum)
        self._installed = list(self.signals)

    def teardown(self, worker: Worker) -> None:
        installed = getattr(self, "_installed", [])
        if not installed:
            return
        loop = asyncio.get_running_loop()
        for signum in installed:
            loop.remove_signal_handler(signum)
            # Still ignored for the rest of the process's life: a late warning must not kill
            # it by default while it closes.
            signal.signal(signum, signal.SIG_IGN)

    def _warned(self, signum: int) -> None:
        if self.received is not None:
            return  # already retiring
        self.received = signum
        name = signal.Signals(signum).name
        logger.warning(
            "Worker %s received %s (preemption warning): finishing its running tasks, "
            "handing the rest back and leaving",
            self.worker.address,
            name,
        )
        self._retiring: Any = asyncio.ensure_future(self._retire(f"preempted ({name})"))

    async def _retire(self, reason: str) -> None:
        """Drain, then what :meth:`distributed.Worker.close_gracefully` does.

        ``closing_gracefully`` first: the scheduler sends no more tasks and the worker starts
        none of those it has queued, while the running ones finish (within
        ``pcm.worker.preemption-drain``) and keep their results. Then the scheduler moves the
        results to other workers and gives them the queued tasks, and the worker leaves.
        """
        worker = self.worker
        if worker.status not in (Status.running, Status.paused):
            return
        drain = parse_timedelta(config.get("worker.preemption-drain"))
        worker.status = Status.closing_gracefully
        deadline = time.monotonic() + drain
        while worker.state.executing_count and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if worker.state.executing_count:
            logger.warning(
                "%s: %d task(s) still running after %.0f s; they will run again elsewhere",
                worker.address,
                worker.state.executing_count,
                drain,
            )
        await worker.scheduler.retire_workers(
            workers=[worker.address],
            close_workers=False,
            remove=True,
            stimulus_id=f"pcm-preempted-{time.time()}",
        )
        await worker.close(nanny=True, reason=reason)


async def dask_setup(worker: Worker) -> None:
    """The worker preload's hook: install :class:`GracefulPreemption` on ``worker``."""
    await worker.plugin_add(GracefulPreemption(), name=NAME)
