"""The worker side: a :class:`distributed.WorkerPlugin` that materialises one context.

One plugin instance per context is registered under :func:`plugin_name`. ``setup`` only
starts a background thread and returns, so a joining worker finishes registering with the
scheduler (and keeps heartbeating) while a model loads for minutes; tasks that need the
context wait for it instead (see :mod:`dask_pcm.tasks`). The load itself runs in that
thread, never on the event loop, inside a host-wide slot so that at most
``pcm.worker.load-concurrency`` loads run at once per host.

Readiness and failures are explicit state on the plugin, read by ``dask_pcm.register``
(which raises for the workers present) and ``dask_pcm.status``. A failure in
``WorkerPlugin.setup`` of a joining worker would otherwise only be logged
(distributed#6906).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distributed import WorkerPlugin

from dask_pcm import config
from dask_pcm.exceptions import ContextLoadError, ContextTimeoutError
from dask_pcm.locks import host_slot

if TYPE_CHECKING:
    from distributed import Worker

    from dask_pcm.context import Context

logger = logging.getLogger(__name__)

PLUGIN_PREFIX = "dask-pcm-context-"

# States a context goes through on one worker.
LOADING = "loading"
FETCHING = "fetching"
READY = "ready"
FAILED = "failed"
CLOSED = "closed"


def plugin_name(context_name: str) -> str:
    """Name under which the plugin for ``context_name`` is registered."""
    return PLUGIN_PREFIX + context_name


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class ContextPlugin(WorkerPlugin):
    """Materialise one :class:`~dask_pcm.Context` on every worker, present or joining.

    Do not register it yourself: :func:`dask_pcm.register` builds one per context and
    registers it with ``Client.register_plugin``, then waits for the present workers.

    At level ``full`` the context is built once and kept until the plugin is removed
    (``dask_pcm.unregister``) or the worker closes. At ``partial`` the template files are
    copied to worker-local disk once and every task builds the context from that copy. At
    ``agnostic`` every task builds it from the source.
    """

    idempotent = False

    def __init__(self, context: Context, level: str) -> None:
        # Pickled and shipped to every worker: keep only the small declaration here.
        self.context = context
        self.level = config.check_level(level)
        self.name = plugin_name(context.name)

    # -- lifecycle -------------------------------------------------------------------------
    def setup(self, worker: Worker) -> None:
        self.worker_address = worker.address
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._closed = False
        self.state = LOADING if self.level == "full" else FETCHING
        self.error: str | None = None
        self.location: str = self.context.template or ""
        self.loads = 0
        self.load_seconds = 0.0
        self.tasks = 0
        self.template_bytes = 0
        self.device: str | None = None
        self._value: Any = None
        self._template_dir = config.get("worker.template-directory") or str(
            Path(worker.local_directory) / "pcm-templates"
        )
        self._thread = threading.Thread(
            target=self._materialise,
            name=f"dask-pcm-load-{self.context.name}",
            daemon=True,
        )
        self._thread.start()

    async def teardown(self, worker: Worker) -> None:
        with self._lock:
            self._closed = True
            value, self._value = self._value, None
            self.state = CLOSED
        self._event.set()
        if value is not None:
            # Freeing a model (and collecting its cycles) takes a fraction of a second: keep
            # it off the event loop like the load.
            await asyncio.to_thread(self._release, value, True)
            logger.info("Released context %r on %s", self.context.name, self.worker_address)

    # -- building --------------------------------------------------------------------------
    def _materialise(self) -> None:
        concurrency = int(config.get("worker.load-concurrency", 1))
        try:
            with host_slot("context-load", concurrency):
                if self._closed:
                    return
                if self.level == "partial":
                    self._stage()
                elif self.level == "full":
                    value = self._build(self.location)
                    with self._lock:
                        if not self._closed:
                            self._value, value = value, None
                    if value is not None:  # torn down while loading
                        self._release(value, collect=True)
                        return
            with self._lock:
                if not self._closed:
                    self.state = READY
            logger.info(
                "Context %r ready on %s (level %s)",
                self.context.name,
                self.worker_address,
                self.level,
            )
        except BaseException as exc:
            with self._lock:
                self.error = _describe(exc)
                if not self._closed:
                    self.state = FAILED
            logger.error(
                "Context %r failed on %s: %s", self.context.name, self.worker_address, self.error
            )
        finally:
            self._event.set()

    def _stage(self) -> None:
        from dask_pcm.sources import stage_template

        staged = stage_template(self.context.template, self._template_dir)
        self.location = str(staged.path)
        self.template_bytes = staged.nbytes
        logger.info(
            "Template of %r %s at %s (%d bytes)",
            self.context.name,
            "copied" if staged.copied else "reused",
            staged.path,
            staged.nbytes,
        )

    def _build(self, location: str) -> Any:
        start = time.perf_counter()
        value = self.context.loader(location)
        elapsed = time.perf_counter() - start
        with self._lock:
            self.loads += 1
            self.load_seconds += elapsed
            if self.device is None:
                self.device = _device_of(value)
        return value

    def _release(self, value: Any, collect: bool = False) -> None:
        # Per task (levels partial/agnostic) only the loader's own release runs: a full
        # gc.collect() costs ~0.4 s in a process holding torch and transformers, more than
        # building a small model, and would bias the comparison between levels.
        release = getattr(self.context.loader, "release", None)
        if release is not None:
            release(value)
        del value
        if collect:
            gc.collect()
            torch = sys.modules.get("torch")
            if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.empty_cache()

    # -- used by tasks ---------------------------------------------------------------------
    def wait_ready(self, timeout: float | None) -> None:
        """Block until the context is ready here; raise if it failed, closed or timed out."""
        if not self._event.wait(timeout):
            raise ContextTimeoutError(
                f"context {self.context.name!r} not ready on worker {self.worker_address} "
                f"after {timeout:g} s (pcm.worker.ready-timeout); it is still {self.state}"
            )
        if self.state == READY:
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

    def acquire(self, timeout: float | None) -> tuple[Any, bool]:
        """The object for one task and whether the task owns it (must release it)."""
        if not self._event.is_set() or self.state != READY:
            self.wait_ready(timeout)
        if self.level == "full":
            value = self._value
            if value is None:  # unregistered between the check and here
                self.wait_ready(0)
            return value, False
        try:
            return self._build(self.location), True
        except BaseException as exc:
            raise ContextLoadError(
                f"context {self.context.name!r} failed to load on worker "
                f"{self.worker_address} from {self.location!r}: {_describe(exc)}",
                {self.worker_address: _describe(exc)},
            ) from exc

    def done(self, value: Any, owned: bool) -> None:
        """Count a served task and drop a per-task object."""
        with self._lock:
            self.tasks += 1
        if owned:
            self._release(value)

    def info(self) -> dict[str, Any]:
        """One status row for this worker and context."""
        with self._lock:
            return {
                "worker": self.worker_address,
                "context": self.context.name,
                "state": self.state,
                "level": self.level,
                "loads": self.loads,
                "load_seconds": round(self.load_seconds, 6),
                "tasks": self.tasks,
                "device": self.device,
                "template": self.context.template,
                "location": self.location,
                "template_bytes": self.template_bytes,
                "error": self.error,
            }


def _device_of(value: Any) -> str | None:
    device = getattr(value, "device", None)
    return None if device is None else str(device)


def context_plugins(worker: Worker) -> dict[str, ContextPlugin]:
    """The context plugins set up on ``worker``, by context name."""
    return {
        p.context.name: p
        for p in worker.plugins.values()
        if isinstance(p, ContextPlugin) and hasattr(p, "state")
    }
