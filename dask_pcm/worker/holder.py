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

from dask_pcm.protocol import EVICTED, READY
from dask_pcm.worker import preimport
from dask_pcm.worker.device import describe_device, size_of
from dask_pcm.worker.lifecycle import Lifecycle

if TYPE_CHECKING:
    from dask_pcm.context import Context

logger = logging.getLogger(__name__)


def _text(value: Any) -> str | None:
    return None if value is None else str(value)


def _use(value: Any) -> dict[str, Any]:
    """What a context's use changes in its record: its batch size (smaller after an
    out-of-memory error) and the size of its kept prefix states."""
    batch_size = getattr(value, "batch_size", None)
    prefixes = getattr(value, "prefix_cache_bytes", 0)
    return {
        "batch_size": batch_size if isinstance(batch_size, int) else None,
        "prefix_cache_bytes": prefixes if isinstance(prefixes, int) else 0,
    }


class Holder:
    """Builds ``context`` and holds what it built; its counts go to ``lifecycle``'s record.

    Its own lock guards what it holds (the resident object, the tasks using it); the
    record has the lifecycle's. Where both are needed (lending, evicting) this lock is taken
    first.
    """

    def __init__(
        self, context: Context, lifecycle: Lifecycle, on_evict: Callable[[], None]
    ) -> None:
        self.context = context
        self.lifecycle = lifecycle
        self.on_evict = on_evict
        self.lock = threading.Lock()
        self.value: Any = None  # the resident context (level full)
        self.active = 0  # tasks holding the context now
        self.last_used = time.monotonic()
        self.closed = False
        self.pending: Any = None  # a closed resident context that tasks still use

    def build(self) -> Any:
        """Build the context from its template's location (a loader call; ``None`` for a
        context without files); counted."""
        life = self.lifecycle
        start = time.perf_counter()
        preimport.wait()  # no import of the same modules in two threads at once
        value = self.context.loader(life.get("location"))
        if getattr(value, "origin", False) is None:
            # Built from this worker's copy: its messages name what the user gave.
            value.origin = self.context.template
        elapsed = time.perf_counter() - start
        life.add(loads=1, load_seconds=elapsed)
        life.update(
            last_load_seconds=elapsed,
            device=life.get("device") or describe_device(value),
            dtype=_text(getattr(value, "dtype", None)),
            warning=_text(getattr(value, "warning", None)),
            **_use(value),
        )
        return value

    def expected_bytes(self) -> int:
        """What a build will hold: its size last time, else the loader's estimate
        (``loader.estimate_bytes(location)``, where the loader has one), else 0."""
        nbytes = self.lifecycle.get("nbytes")
        if nbytes:
            return int(nbytes)
        estimate = getattr(self.context.loader, "estimate_bytes", None)
        if estimate is None:
            return 0
        try:
            return max(0, int(estimate(self.lifecycle.get("location"))))
        except Exception as exc:  # an estimate is advice: the build reports real problems
            logger.debug("No size estimate for context %r: %r", self.context.name, exc)
            return 0

    def keep(self, value: Any) -> None:
        """Make ``value`` the resident context, unless closed meanwhile (then free it)."""
        nbytes = size_of(value)
        with self.lock:
            if not self.closed:
                self.value, value = value, None
                self.last_used = time.monotonic()
        if value is None:
            self.lifecycle.update(nbytes=nbytes)
        else:
            self.release(value, collect=True)

    def close(self) -> Any:
        """No more keeping: the resident object, for the caller to release."""
        with self.lock:
            self.closed = True
            value, self.value = self.value, None
        return value

    def release(self, value: Any, collect: bool = False) -> None:
        """Free a built context (the loader's ``release``, then, if ``collect``, a full
        garbage collection and the GPU's cached memory)."""
        # Per task (levels partial/agnostic) only the loader's own release runs: a full
        # gc.collect() in a process holding torch and transformers can take longer than
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
            if self.active or self.value is None:
                return 0
            if not self.lifecycle.move(EVICTED, only_from=(READY,)):
                return 0
            value, self.value = self.value, None
        freed = int(self.lifecycle.get("nbytes"))
        self.on_evict()
        self.release(value, collect=True)
        logger.info(
            "Evicted context %r on %s (%d bytes, least recently used)",
            self.context.name,
            self.lifecycle.get("worker"),
            freed,
        )
        return freed

    def lend(self) -> tuple[bool, Any]:
        """``(True, resident object)`` for a task if the context is ready, else ``(False, None)``."""
        with self.lock:
            if self.closed or self.lifecycle.state != READY:
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
            pending = None
            if not self.active and self.pending is not None:
                pending, self.pending = self.pending, None
        if value is not None:
            # A context that halved its batches after running out of memory says so.
            self.lifecycle.update(**_use(value))
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
