"""The worker side: a :class:`distributed.WorkerPlugin` that materialises one context.

One plugin instance per context is registered under :func:`plugin_name`. ``setup`` only
starts a background thread and returns, so a joining worker finishes registering with the
scheduler (and keeps heartbeating) while a model loads for minutes; tasks that need the
context wait for it instead (see :mod:`dask_pcm.tasks`). The work itself runs in that thread,
never on the event loop: the template copy first (:mod:`dask_pcm.worker.template`; outside
the host's load slot, since it waits on the network), then what the level prepares
(:mod:`dask_pcm.worker.levels`: a table of flags this plugin reads), inside a host-wide slot
where one protects something (:func:`load_slot`), so that at most
``pcm.worker.load-concurrency`` such loads run at once per host.

The context's state changes only through its :class:`~dask_pcm.worker.lifecycle.Lifecycle`,
which refuses a transition its level does not allow and is the one writer of the status
record. Every change is reported to the scheduler plugin as the context's status record
(:class:`dask_pcm.protocol.ContextStatus`) over the worker's batched stream, the same ordered
channel that carries "task finished" messages: the scheduler never sees a task finish before
the load that preceded it. A report made while the worker is not yet connected (a joining
worker whose context loads fast) is resent once it is. A failure in ``WorkerPlugin.setup`` of
a joining worker would otherwise only be logged (distributed#6906); here it becomes state
``failed`` with the loader's message.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from distributed import WorkerPlugin

from dask_pcm import config
from dask_pcm.engine.model import build_for_one_task
from dask_pcm.exceptions import (
    ChunkError,
    ContextLoadError,
    ContextTimeoutError,
    TemplateFetchError,
)
from dask_pcm.gpus import visible_gpus
from dask_pcm.locks import host_slot
from dask_pcm.protocol import (
    CLOSED,
    EVICTED,
    FAILED,
    FETCHING,
    LOADING,
    PLUGIN_PREFIX,
    READY,
    ContextStatus,
    plugin_name,
)
from dask_pcm.worker.budget import MemoryBudget
from dask_pcm.worker.holder import Holder
from dask_pcm.worker.levels import LEVELS
from dask_pcm.worker.lifecycle import Lifecycle
from dask_pcm.worker.report import Reporter
from dask_pcm.worker.template import WorkerTemplate

if TYPE_CHECKING:
    from distributed import Worker

    from dask_pcm.context import Context

logger = logging.getLogger(__name__)

__all__ = ["PLUGIN_PREFIX", "ContextPlugin", "context_plugins", "plugin_name"]


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def explain(exc: BaseException, template: str | None, location: str | None) -> str:
    """A failure as the user should read it: a build from the worker's own copy of the
    template (``location``) also names the user's source, where a damaged file must be fixed."""
    text = _describe(exc)
    if isinstance(exc, (ChunkError, TemplateFetchError)) or not location:
        return text  # the copy failed, not the build: its message says where and why
    if template and location != template:
        return f"{text} (building from {location!r}, this worker's copy of {template!r})"
    return f"{text} (building from {location!r})"


def load_slot(reads_source: bool) -> contextlib.AbstractContextManager[Any]:
    """The host-wide slot a build takes (``pcm.worker.load-concurrency`` per host): on a
    worker that sees a GPU (loads stage the model in host memory and fill the device: two at
    once can run either out), and for builds that read the template's source (level
    ``agnostic``: the shared filesystem). A CPU-only worker building from its local copy
    takes none: its load protects nothing from another's, and taking turns only delays the
    second worker."""
    if reads_source or visible_gpus():
        return host_slot("context-load", int(config.get("worker.load-concurrency")))
    return contextlib.nullcontext()


class ContextPlugin(WorkerPlugin):
    """Materialise one :class:`~dask_pcm.Context` on every worker, present or joining.

    Do not register it yourself: :func:`dask_pcm.register` builds one of these per context
    and has the scheduler declare the context and register it
    (:mod:`dask_pcm.scheduler.registration`), then waits for the present workers.

    At level ``full`` the context is built once and kept until the plugin is removed
    (``dask_pcm.unregister``), the worker closes, or it is evicted under the memory budget
    (then rebuilt by the next task that needs it). At ``partial`` the template files are
    copied to worker-local disk once and every task builds the context from that copy. At
    ``agnostic`` every task builds it from the source.
    """

    idempotent = False

    def __init__(
        self,
        context: Context,
        level: str,
        manifest: str | None = None,
        registration: str | None = None,
        host_stamp: str | None = None,
    ) -> None:
        # Pickled and shipped to every worker: keep only the small declaration here.
        self.context = context
        self.level = config.check_level(level)
        self.name = plugin_name(context.name)
        # The template's chunk manifest (JSON) when it can travel peer to peer.
        self.manifest = manifest
        # The stamp of a host copy that the registering client made (a local cluster's
        # run, dask_pcm.templates.local.HostCopy): its workers trust a copy carrying it.
        self.host_stamp = host_stamp
        # Tags this plugin's reports, so the scheduler tells them from those of the plugin
        # it replaced (dask_pcm.scheduler.registration).
        self.registration = registration

    # -- lifecycle -------------------------------------------------------------------------
    def setup(self, worker: Worker) -> None:
        self._worker = worker
        self.worker_address = worker.address
        self._event = threading.Event()  # set when a load attempt ends
        level = LEVELS[self.level]
        self._copies = level.copies_template(
            has_manifest=self.manifest is not None, has_files=self.context.template is not None
        )
        # Fetching while the template is copied, then loading the context.
        self.lifecycle = Lifecycle(
            worker.address,
            self.context.name,
            level,
            FETCHING if self._copies else LOADING,
            template=self.context.template,
            location=self.context.template,
        )
        self.reporter = Reporter(worker, self.lifecycle.report, self.registration)
        self.lifecycle.changed = self.reporter.changed
        self.template = WorkerTemplate(
            worker,
            self.context.template,
            self.manifest,
            self.lifecycle,
            self.context.loader,
            known_stamp=self.host_stamp,
        )
        self.holder = Holder(self.context, self.lifecycle, self._event.clear)
        self.budget = MemoryBudget.of(worker)
        self.reporter.changed()
        self._start_load()

    async def teardown(self, worker: Worker) -> None:
        value = self.holder.close()  # lends and keeps nothing more
        self.lifecycle.move(CLOSED)
        self._event.set()
        self.reporter.flush()
        if value is None:
            return
        if worker.status.name in ("closing", "closed", "closing_gracefully", "failed"):
            # The worker is shutting down: free the model's memory here, without the full
            # gc.collect() (slow in a process holding torch), which would hold up Worker.close
            # (it tears plugins down before it stops heartbeating: heartbeats to a scheduler
            # already gone, logged as errors). Not in a background thread: a thread still
            # inside torch when the process exits made it abort ("terminate called without an
            # active exception", in many cluster closes; in none without the thread).
            self.holder.release(value)
            return
        # Tasks still using the context keep it until they finish (bounded): freeing a
        # model under a running forward pass would fail that task.
        timeout = config.release_timeout()
        idle = await asyncio.to_thread(self.holder.wait_idle, timeout)
        if not idle and self.holder.release_when_idle(value):
            logger.warning(
                "Context %r on %s is still used by tasks after %g s: the last of them frees it",
                self.context.name,
                self.worker_address,
                timeout,
            )
            return
        # Freeing a model (and collecting its cycles) takes a fraction of a second: keep it
        # off the event loop like the load.
        await asyncio.to_thread(self.holder.release, value, True)
        logger.info("Released context %r on %s", self.context.name, self.worker_address)

    # -- the record, as others read it --------------------------------------------------------
    @property
    def state(self) -> str:
        return self.lifecycle.state

    @property
    def error(self) -> str | None:
        return self.lifecycle.get("error")

    @property
    def record(self) -> ContextStatus:
        """A copy of the context's status record on this worker, as it is now."""
        return self.lifecycle.record()

    # -- building --------------------------------------------------------------------------
    def _start_load(self) -> None:
        self._event.clear()
        thread = threading.Thread(
            target=self._materialise,
            name=f"dask-pcm-load-{self.context.name}",
            daemon=True,
        )
        thread.start()

    def _materialise(self) -> None:
        try:
            ready = self._prepare()
        finally:
            self._event.set()
        if ready and self.lifecycle.level.resident:
            self.make_room(0)  # for its real size, now known

    def _prepare(self) -> bool:
        """Copy, build or measure what the level keeps; whether the context became ready."""
        level = self.lifecycle.level
        try:
            if self._copies:
                self.template.copy()
            if level.resident:  # rebuilt after an eviction: loading already
                self.lifecycle.move(LOADING, only_from=(FETCHING,))
            with load_slot(level.reads_source_per_task):
                if self.lifecycle.closed:
                    return False
                if level.resident:
                    # Room first, for what the context took last time or, at its first load,
                    # what the loader expects (CausalLM: the weights on disk).
                    self.make_room(self.holder.expected_bytes())
                    self.holder.keep(self.holder.build())
                elif level.reads_source_per_task:
                    self.template.measure_source()
            if not self.lifecycle.move(READY):
                return False  # closed meanwhile
        except BaseException as exc:
            if self.lifecycle.closed:  # the worker is closing: cut short, not broken
                logger.info(
                    "Load of context %r on %s abandoned at close (%s)",
                    self.context.name,
                    self.worker_address,
                    _describe(exc),
                )
                return False
            self.lifecycle.move(FAILED, self._explain(exc))
            logger.error(
                "Context %r failed on %s: %s", self.context.name, self.worker_address, self.error
            )
            return False
        logger.info(
            "Context %r ready on %s (level %s)", self.context.name, self.worker_address, self.level
        )
        return True

    def _explain(self, exc: BaseException) -> str:
        return explain(exc, self.context.template, self.lifecycle.get("location"))

    # -- memory budget ---------------------------------------------------------------------
    def make_room(self, incoming: int) -> None:
        """Evict idle resident contexts of this worker until ``incoming`` more bytes fit."""
        plugins = context_plugins(self._worker).values()
        resident = [p.holder for p in plugins if p.lifecycle.level.resident]
        self.budget.make_room(self.holder, resident, incoming)

    # -- used by tasks ---------------------------------------------------------------------
    def wait_ready(self, timeout: float | None) -> None:
        """Block until the context is ready here; raise if it failed, closed or timed out.

        An evicted context is rebuilt first.
        """
        if self.lifecycle.move(LOADING, only_from=(EVICTED,)):
            logger.info(
                "Rebuilding evicted context %r on %s", self.context.name, self.worker_address
            )
            self._start_load()
        if not self._event.wait(timeout):
            raise ContextTimeoutError(
                f"context {self.context.name!r} not ready on worker {self.worker_address} "
                f"after {timeout:g} s (pcm.worker.ready-timeout); it is still {self.state}"
            )
        if self.state in (READY, EVICTED):
            return
        if self.state == FAILED:
            raise ContextLoadError(
                f"context {self.context.name!r} failed to load on worker "
                f"{self.worker_address}: {self.error}",
                {self.worker_address: self.error or ""},
            )
        raise ContextLoadError(
            f"context {self.context.name!r} was unregistered from worker {self.worker_address}"
        )

    def acquire(self, timeout: float | str | None = "configured") -> tuple[Any, bool]:
        """The object for one task and whether the task owns it (must release it).

        Waits at most ``timeout`` seconds for the context (``"configured"``:
        ``pcm.worker.ready-timeout``, read only when there is something to wait for).
        """
        deadline: float | None = None
        while True:
            lent, value = self.holder.lend()
            if lent:
                break
            if deadline is None:
                seconds = config.ready_timeout() if timeout == "configured" else timeout
                if seconds is None:
                    self.wait_ready(None)
                    continue
                deadline = time.monotonic() + float(seconds)
            self.wait_ready(max(0.0, deadline - time.monotonic()))
        try:
            return self._take(value)
        except BaseException as exc:
            self.holder.returned(None, owned=False)
            raise ContextLoadError(
                f"context {self.context.name!r} failed to load on worker "
                f"{self.worker_address}: {self._explain(exc)}",
                {self.worker_address: self._explain(exc)},
            ) from exc

    def _take(self, resident: Any) -> tuple[Any, bool]:
        level = self.lifecycle.level
        if level.resident:
            return resident, False
        if level.reads_source_per_task:
            self.template.read_source()
        with build_for_one_task():
            return self.holder.build(), True

    def done(self, value: Any, owned: bool) -> None:
        """A task is done with the context; drop a per-task object."""
        self.holder.returned(value, owned)


def context_plugins(worker: Worker) -> dict[str, ContextPlugin]:
    """The context plugins set up on ``worker``, by context name."""
    return {
        p.context.name: p
        for p in list(worker.plugins.values())  # a snapshot: load threads call this too
        if isinstance(p, ContextPlugin) and hasattr(p, "lifecycle")
    }
