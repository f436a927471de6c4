"""The scheduler plugin: it tracks contexts per worker and steers context tasks.

:class:`ContextScheduler` is the :class:`distributed.SchedulerPlugin` that
:func:`dask_pcm.register` installs before any context. It wires the scheduler's hooks and
handlers to the parts that do the work:

- :class:`~dask_pcm.scheduler.state.ContextStates`: the state machine per worker and context,
  driven by the reports the worker plugins send over their batched streams::

      absent -> fetching -> loading -> ready
                    \\           \\-> failed
                     \\-> failed     ready -> evicted -> loading -> ready

- :class:`~dask_pcm.scheduler.steering.Steering`: restriction sets that send context tasks
  only to workers where their contexts are ready (see that module for the rules);
- :class:`~dask_pcm.scheduler.directory.ChunkDirectory`: who holds which template chunk;
- :class:`~dask_pcm.scheduler.readiness.Readiness`: ``register``'s wait until the contexts
  are ready or failed on every worker (the ``pcm_settle`` handler), woken by the reports;
- :func:`~dask_pcm.scheduler.adaptive.keep_workers`: what adaptive scaling must not retire;
- the dashboard routes and Prometheus metrics.

Tasks served are counted here, from the scheduler's own transitions (a context task that
finished on a worker, or erred there), so status costs nothing per task on the workers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from distributed import SchedulerPlugin
from tornado.ioloop import PeriodicCallback

from dask_pcm import protocol
from dask_pcm.exceptions import ContextNotFoundError
from dask_pcm.scheduler import adaptive, dashboard, metrics
from dask_pcm.scheduler.directory import ChunkDirectory
from dask_pcm.scheduler.readiness import Readiness
from dask_pcm.scheduler.state import ContextStates
from dask_pcm.scheduler.steering import Steering

if TYPE_CHECKING:
    from distributed import Scheduler

logger = logging.getLogger(__name__)

PLUGIN_NAME = "dask-pcm"


class ContextScheduler(SchedulerPlugin):
    """Track contexts per worker and steer context tasks to workers where they are ready.

    Installed by the scheduler preload (:mod:`dask_pcm.scheduler.preload`), or by
    :func:`dask_pcm.register` where none did; one per scheduler. See the module docstring.
    """

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self) -> None:
        # Pickled and shipped to the scheduler: the parts are built in start().
        self.scheduler: Scheduler | None = None

    # -- plugin hooks ----------------------------------------------------------------------
    async def start(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.states = ContextStates()
        self.steering = Steering(scheduler, self.states)
        self.directory = ChunkDirectory(
            whole_copies=lambda digest: self.states.holders(digest) & set(scheduler.workers),
            connected=lambda: scheduler.workers,
        )
        self.readiness = Readiness(scheduler, self.states, self.unregister)
        self._handlers: dict[str, Callable[..., Any]] = {
            protocol.CHUNK_PLAN_OP: self.directory.plan_waiting,
            protocol.CHUNK_HAVE_OP: self.directory.have,
            protocol.KEEP_WORKERS_OP: self.keep_workers,
            protocol.SETTLE_OP: self.readiness.settle,
        }
        scheduler.stream_handlers[protocol.STATE_OP] = self.on_state
        scheduler.handlers.update(self._handlers)
        self._stuck_check = PeriodicCallback(self.steering.fail_stuck, 1000)
        self._stuck_check.start()
        self._http_app = dashboard.install(self)
        metrics.track(self.states)
        self._quiet = QuietLosses()
        logging.getLogger("distributed.scheduler").addFilter(self._quiet)

    async def close(self) -> None:
        if self.scheduler is None:
            return
        self.scheduler.stream_handlers.pop(protocol.STATE_OP, None)
        for op in self._handlers:
            self.scheduler.handlers.pop(op, None)
        self._stuck_check.stop()
        logging.getLogger("distributed.scheduler").removeFilter(self._quiet)
        dashboard.uninstall(self, self._http_app)
        metrics.untrack(self.states)

    def add_worker(self, scheduler: Scheduler, worker: str) -> None:
        self.states.add_worker(worker)
        # Runs before the scheduler offers the new worker any task: restrict the free
        # context tasks now, so none goes to a worker that has not loaded its context.
        self.steering.refresh(self.states.levels, stimulus_id=f"pcm-add-worker-{time.time()}")

    def remove_worker(self, scheduler: Scheduler, worker: str, **kwargs: Any) -> None:
        self.directory.remove_worker(worker)
        changed = self.states.remove_worker(worker)
        if changed:
            self.steering.refresh(changed, stimulus_id=f"pcm-remove-worker-{time.time()}")
        self.readiness.changed()

    def update_graph(self, scheduler: Scheduler, *, tasks: list[Any], **kwargs: Any) -> None:
        self.steering.new_tasks(tasks)
        limit_losses(scheduler, tasks)

    def transition(
        self, key: Any, start: str, finish: str, *args: Any, stimulus_id: str, **kwargs: Any
    ) -> None:
        names = self.steering.needs.get(key)
        if names is None:
            return
        if start == "processing" and finish in ("memory", "erred"):
            self.states.task_done(names, kwargs.get("worker", ""), ok=finish == "memory")
        elif finish == "forgotten":
            self.steering.forget_task(key)

    # -- declarations (from dask_pcm.register / unregister) ---------------------------------
    def declare(
        self, name: str, level: str, token: str | None = None, registration: str | None = None
    ) -> None:
        """A context was registered: expect a report from every worker.

        With a ``registration`` id (a new worker plugin, :mod:`.registration`), what the
        workers reported of the context so far is dropped, and only reports tagged with that
        id count from now on.
        """
        assert self.scheduler is not None
        if registration is not None:
            self.readiness.declared(name, token or "", registration)
        self.states.declare(name, level, self.scheduler.workers, fresh=registration is not None)
        self.steering.refresh([name], stimulus_id=f"pcm-declare-{time.time()}")

    def forget(self, name: str) -> None:
        """A context was unregistered: its waiting tasks err, its state goes."""
        self.states.forget(name)
        self.readiness.forget(name)
        self.steering.refresh([name], stimulus_id=f"pcm-forget-{time.time()}")

    async def unregister(self, name: str) -> None:
        """Unregister a context from the scheduler and every worker."""
        assert self.scheduler is not None
        self.forget(name)
        try:
            responses = await self.scheduler.unregister_worker_plugin(
                None, protocol.plugin_name(name)
            )
        except OSError as exc:  # a worker left meanwhile: it has no plugin to remove
            logger.warning("Unregistering context %r: %s", name, exc)
            return
        for worker, response in responses.items():
            if isinstance(response, dict) and response.get("status") == "error":
                logger.warning("Context %r on %s: %s", name, worker, response.get("exception_text"))

    # -- handlers ----------------------------------------------------------------------------
    def on_state(self, worker: str, context: str, state: str, seq: int, **info: Any) -> None:
        """Stream handler: a worker plugin's report (:data:`~dask_pcm.protocol.STATE_OP`)."""
        assert self.scheduler is not None
        if worker not in self.scheduler.workers:
            return  # a late message from a removed worker
        if not self.readiness.current(context, info.pop("registration", None)):
            return  # from the plugin a later registration replaced
        if self.states.report(worker, context, state, seq, info):
            self.steering.refresh([context], stimulus_id=f"pcm-{state}-{time.time()}")
        self.readiness.changed()

    def keep_workers(self, names: list[Any]) -> list[Any]:
        """RPC handler: of the workers named ``names`` (to be retired), those to keep
        (:func:`dask_pcm.scheduler.adaptive.keep_workers`)."""
        assert self.scheduler is not None
        workers = self.scheduler.workers
        leaving = adaptive.by_name(workers, names)
        keep = adaptive.keep_workers(self.states, self.steering.wanted(), leaving)
        return [workers[addr].name for addr in sorted(keep)]

    # -- reading ---------------------------------------------------------------------------
    def rows(self, contexts: Any = None) -> list[dict[str, Any]]:
        """Status rows, sorted by context then worker."""
        return self.states.rows(contexts)

    def summary(self) -> dict[str, dict[str, Any]]:
        """Per context: level, workers per state, tasks served, tasks queued or running, and
        of those the tasks waiting for a worker where it is ready."""
        return self.states.summary(self.steering.waiting(), self.steering.pending())


def limit_losses(scheduler: Scheduler, keys: list[Any]) -> None:
    """Tasks annotated with :data:`~dask_pcm.protocol.LOSSES_ANNOTATION` = ``n`` err with
    ``KilledWorker`` after ``n`` worker deaths: their count of deaths starts where the
    scheduler's ``allowed_failures`` leaves only ``n``."""
    allowed = scheduler.allowed_failures
    for key in keys:
        ts = scheduler.tasks.get(key)
        losses = (ts.annotations or {}).get(protocol.LOSSES_ANNOTATION) if ts else None
        if losses:
            assert ts is not None
            ts.suspicious = max(ts.suspicious, allowed + 1 - int(losses))


class QuietLosses(logging.Filter):
    """Lowers distributed's ERRORs about the batch layer's tasks (keys starting
    :data:`~dask_pcm.protocol.SPLITTABLE_PREFIX`) that a worker lost to preemption causes:

    - "Task ... marked as failed because N workers died" to DEBUG: the count is the preset
      of :data:`~dask_pcm.protocol.LOSSES_ANNOTATION`, not N deaths, and the client that
      submitted the task logs one line and runs its rows again;
    - "Couldn't gather keys" (the worker holding a result left before the client fetched it)
      to WARNING: the scheduler computes the result again and the client receives it then.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR or not record.args:
            return True
        # logging keeps a lone mapping argument as the args themselves
        args = record.args
        text, first = str(record.msg), args[0] if isinstance(args, tuple) else args
        if "workers died while trying" in text and _ours(first):
            return _lower(record, logging.DEBUG)
        if "Couldn't gather keys" in text and isinstance(first, dict) and all(map(_ours, first)):
            return _lower(record, logging.WARNING)
        return True


def _ours(key: object) -> bool:
    return str(key).startswith(protocol.SPLITTABLE_PREFIX)


def _lower(record: logging.LogRecord, level: int) -> bool:
    record.levelno, record.levelname = level, logging.getLevelName(level)
    return logging.getLogger(record.name).isEnabledFor(level)


def get_plugin(scheduler: Scheduler) -> ContextScheduler:
    """The :class:`ContextScheduler` installed on ``scheduler``."""
    plugin = scheduler.plugins.get(PLUGIN_NAME)
    if not isinstance(plugin, ContextScheduler):
        raise ContextNotFoundError(
            "dask_pcm's scheduler plugin is not installed on this scheduler: "
            "call dask_pcm.register(client, context) first"
        )
    return plugin
