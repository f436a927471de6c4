"""The built context on one worker: built by the loader, kept (level ``full``), lent to
tasks, evicted and freed.

:class:`Holder` counts every build in the context's status record (loads, time, device,
batch size) and keeps the resident object with the tasks using it, so that the memory budget
(:mod:`dask_pcm.worker.budget`) can evict only idle contexts, least recently used first.
"""

from __future__ import annotations

import gc
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dask_pcm.protocol import EVICTED, READY, ContextStatus
from dask_pcm.worker.device import describe_device, size_of
from dask_pcm.worker.report import Reporter

if TYPE_CHECKING:
    from dask_pcm.context import Context

logger = logging.getLogger(__name__)


def _text(value: Any) -> str | None:
    return None if value is None else str(value)


class Holder:
    """Builds ``context`` and holds what it built; state lives in ``record`` under ``lock``."""

    def __init__(
        self,
        context: Context,
        record: ContextStatus,
        lock: threading.Lock,
        reporter: Reporter,
        on_evict: Callable[[], None],
    ) -> None:
        self.context = context
        self.record = record
        self.lock = lock
        self.reporter = reporter
        self.on_evict = on_evict
        self.value: Any = None  # the resident context (level full)
        self.active = 0  # tasks holding the context now
        self.last_used = time.monotonic()
        self.closed = False
        self.pending: Any = None  # a closed resident context that tasks still use

    def build(self) -> Any:
        """Build the context from its template's location (a loader call; ``None`` for a
        context without files); counted."""
        start = time.perf_counter()
        value = self.context.loader(self.record.location)
        elapsed = time.perf_counter() - start
        with self.lock:
            self.record.loads += 1
            self.record.load_seconds += elapsed
            self.record.last_load_seconds = elapsed
            if self.record.device is None:
                self.record.device = describe_device(value)
            self.record.dtype = _text(getattr(value, "dtype", None))
            self.record.warning = _text(getattr(value, "warning", None))
            self._note_use(value)
        self.reporter.changed()
        return value

    def _note_use(self, value: Any) -> bool:
        """Record what a context's use changes (under lock): its batch size (smaller after an
        out-of-memory error) and its prefix states' size; whether either changed."""
        batch_size = getattr(value, "batch_size", None)
        batch_size = batch_size if isinstance(batch_size, int) else None
        prefixes = getattr(value, "prefix_cache_bytes", 0)
        prefixes = prefixes if isinstance(prefixes, int) else 0
        changed = (batch_size, prefixes) != (self.record.batch_size, self.record.prefix_cache_bytes)
        self.record.batch_size, self.record.prefix_cache_bytes = batch_size, prefixes
        return changed

    def expected_bytes(self) -> int:
        """What a build will hold: its size last time, else the loader's estimate
        (``loader.estimate_bytes(location)``, where the loader has one), else 0."""
        if self.record.nbytes:
            return self.record.nbytes
        estimate = getattr(self.context.loader, "estimate_bytes", None)
        if estimate is None:
            return 0
        try:
            return max(0, int(estimate(self.record.location)))
        except Exception as exc:  # an estimate is advice: the build reports real problems
            logger.debug("No size estimate for context %r: %r", self.context.name, exc)
            return 0

    def keep(self, value: Any) -> None:
        """Make ``value`` the resident context, unless closed meanwhile (then free it)."""
        nbytes = size_of(value)
        with self.lock:
            if not self.closed:
                self.value, value = value, None
                self.record.nbytes = nbytes
                self.last_used = time.monotonic()
        if value is not None:
            self.release(value, collect=True)

    def close(self) -> Any:
        """No more keeping: the resident object, for the caller to release (under lock)."""
        self.closed = True
        value, self.value = self.value, None
        return value

    def release(self, value: Any, collect: bool = False) -> None:
        """Free a built context (the loader's ``release``, then, if ``collect``, a full
        garbage collection and the GPU's cached memory)."""
        # Per task (levels partial/agnostic) only the loader's own release runs: a full
        # gc.collect() costs ~0.4 s in a process holding torch and transformers, more than
        # building a small model, and would bias the comparison between levels.
        release = getattr(self.context.loader, "release", None)
        if callable(release):  # a loader may have a plain attribute of that name
            release(value)
        del value
        if collect:
            gc.collect()
            torch = sys.modules.get("torch")  # only if the loader imported it
            if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.empty_cache()

    def evict(self) -> int:
        """Drop the resident object if no task holds it; the bytes freed."""
        with self.lock:
            if self.record.state != READY or self.active or self.value is None:
                return 0
            value, self.value = self.value, None
            self.record.state = EVICTED
            self.record.evictions += 1
            freed = self.record.nbytes
        self.on_evict()
        self.reporter.changed()
        self.release(value, collect=True)
        logger.info(
            "Evicted context %r on %s (%d bytes, least recently used)",
            self.context.name,
            self.record.worker,
            freed,
        )
        return freed

    def lend(self) -> tuple[bool, Any]:
        """``(True, resident object)`` for a task if the context is ready, else ``(False, None)``."""
        with self.lock:
            if self.record.state != READY:
                return False, None
            self.active += 1
            self.last_used = time.monotonic()
            return True, self.value

    def returned(self, value: Any, owned: bool) -> None:
        """A task is done with the context; a per-task object (``owned``) is freed, and so is
        a resident one left to the last task by :meth:`release_when_idle`."""
        with self.lock:
            self.active -= 1
            self.last_used = time.monotonic()
            # A context that halved its batches after running out of memory says so.
            changed = value is not None and self._note_use(value)
            pending = None
            if not self.active and self.pending is not None:
                pending, self.pending = self.pending, None
        if changed:
            self.reporter.changed()
        if owned:
            self.release(value)
        if pending is not None:
            self.release(pending, collect=True)
            logger.info("Released context %r after its last task", self.context.name)

    def wait_idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until no task holds the context; whether none does."""
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                if not self.active:
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    def release_when_idle(self, value: Any) -> bool:
        """Leave freeing ``value`` to the last running task; ``False`` if none runs (free it
        yourself)."""
        with self.lock:
            if not self.active:
                return False
            self.pending = value
            return True
