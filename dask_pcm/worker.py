"""The worker side: a :class:`distributed.WorkerPlugin` that materialises one context.

One plugin instance per context is registered under :func:`plugin_name`. ``setup`` only
starts a background thread and returns, so a joining worker finishes registering with the
scheduler (and keeps heartbeating) while a model loads for minutes; tasks that need the
context wait for it instead (see :mod:`dask_pcm.tasks`). The load itself runs in that
thread, never on the event loop, inside a host-wide slot so that at most
``pcm.worker.load-concurrency`` loads run at once per host.

Every change of state is reported to the scheduler plugin
(:class:`dask_pcm.scheduler.ContextScheduler`) as a full snapshot over the worker's batched
stream, the same ordered channel that carries "task finished" messages: the scheduler never
sees a task finish before the load that preceded it. A snapshot taken while the worker is
not yet connected (a joining worker whose context loads fast) is resent once it is. A
failure in ``WorkerPlugin.setup`` of a joining worker would otherwise only be logged
(distributed#6906); here it becomes state ``failed`` with the loader's message.

Memory budget: several contexts at level ``full`` may share a worker within
``pcm.worker.context-memory-limit``. Before a load, and again once the real size is known,
the least recently used *idle* contexts (no task holding them) are evicted; an evicted
context is rebuilt on demand by the next task that needs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import platform
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

import dask.utils
from distributed import WorkerPlugin

from dask_pcm import config
from dask_pcm.exceptions import ContextLoadError, ContextTimeoutError
from dask_pcm.locks import host_slot

if TYPE_CHECKING:
    from distributed import Worker

    from dask_pcm.context import Context

logger = logging.getLogger(__name__)

PLUGIN_PREFIX = "dask-pcm-context-"
STATE_OP = "pcm-context-state"  # stream handler installed by the scheduler plugin

# States a context goes through on one worker.
FETCHING = "fetching"
LOADING = "loading"
READY = "ready"
FAILED = "failed"
EVICTED = "evicted"
CLOSED = "closed"

_RESEND_SECONDS = 0.5


def plugin_name(context_name: str) -> str:
    """Name under which the plugin for ``context_name`` is registered."""
    return PLUGIN_PREFIX + context_name


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


# One lock per worker serialises eviction decisions between its context plugins.
_budget_locks: weakref.WeakKeyDictionary[Any, threading.Lock] = weakref.WeakKeyDictionary()
_budget_locks_guard = threading.Lock()


def _budget_lock(worker: Any) -> threading.Lock:
    with _budget_locks_guard:
        lock = _budget_locks.get(worker)
        if lock is None:
            lock = _budget_locks[worker] = threading.Lock()
        return lock


class ContextPlugin(WorkerPlugin):
    """Materialise one :class:`~dask_pcm.Context` on every worker, present or joining.

    Do not register it yourself: :func:`dask_pcm.register` installs the scheduler plugin
    first, builds one of these per context and registers it with
    ``Client.register_plugin``, then waits for the present workers.

    At level ``full`` the context is built once and kept until the plugin is removed
    (``dask_pcm.unregister``), the worker closes, or it is evicted under the memory budget
    (then rebuilt by the next task that needs it). At ``partial`` the template files are
    copied to worker-local disk once and every task builds the context from that copy. At
    ``agnostic`` every task builds it from the source.
    """

    idempotent = False

    def __init__(self, context: Context, level: str, manifest: str | None = None) -> None:
        # Pickled and shipped to every worker: keep only the small declaration here.
        self.context = context
        self.level = config.check_level(level)
        self.name = plugin_name(context.name)
        # The template's chunk manifest (JSON) when it can travel peer to peer (see p2p.py).
        self.manifest = manifest

    # -- lifecycle -------------------------------------------------------------------------
    def setup(self, worker: Worker) -> None:
        self._worker = worker
        self.worker_address = worker.address
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._closed = False
        # Fetching while the template is copied (or staged), then loading the context.
        copies = self.manifest is not None or self.level != "full"
        self.state = FETCHING if copies else LOADING
        self.error: str | None = None
        self.location: str = self.context.template or ""
        self.loads = 0
        self.load_seconds = 0.0
        self.last_load_seconds = 0.0
        self.evictions = 0
        self.tasks = 0
        self.active = 0
        self.last_used = time.monotonic()
        self.nbytes = 0
        self.template_bytes = 0
        self.template_digest: str | None = None
        self.template_held = False
        self.bytes_from_peers = 0
        self.bytes_from_source = 0
        self.corrupted_chunks = 0
        self.fetch_seconds = 0.0
        self.device: str | None = None
        self.batch_size: int | None = None
        self._value: Any = None
        self._version = 0
        self._sent_version = -1
        self._send_scheduled = False
        self._template_dir = config.get("worker.template-directory") or str(
            Path(worker.local_directory) / "pcm-templates"
        )
        self._notify()
        self._start_load()

    async def teardown(self, worker: Worker) -> None:
        with self._lock:
            self._closed = True
            value, self._value = self._value, None
            self.state = CLOSED
            self._version += 1
        self._event.set()
        self._send_snapshot()
        if value is None:
            return
        if worker.status.name in ("closing", "closed", "closing_gracefully", "failed"):
            # The worker is shutting down: free the model's memory here, without the full
            # gc.collect() (~0.4 s), which would hold up Worker.close (it tears plugins down
            # before it stops heartbeating: heartbeats to a scheduler already gone, logged as
            # errors). Not in a background thread: a thread still inside torch when the process
            # exits made it abort ("terminate called without an active exception", about one
            # cluster close in two with two workers; none in eight closes without the thread).
            self._release(value)
            return
        # Freeing a model (and collecting its cycles) takes a fraction of a second: keep it
        # off the event loop like the load.
        await asyncio.to_thread(self._release, value, True)
        logger.info("Released context %r on %s", self.context.name, self.worker_address)

    # -- reporting to the scheduler --------------------------------------------------------
    def _notify(self) -> None:
        """Schedule a snapshot for the scheduler (from any thread)."""
        with self._lock:
            self._version += 1
            if self._send_scheduled:
                return
            self._send_scheduled = True
        # A closed loop means the worker is going away: nothing to report to.
        with contextlib.suppress(RuntimeError):
            self._worker.loop.add_callback(self._send_snapshot)

    def _send_snapshot(self) -> None:
        """Send the latest state over the batched stream; retry until connected."""
        with self._lock:
            self._send_scheduled = False
            if self._sent_version == self._version:
                return
            version = self._version
        stream = getattr(self._worker, "batched_stream", None)
        comm = getattr(stream, "comm", None)
        if stream is None or comm is None or comm.closed():
            if self._worker.status.name in ("closing", "closed", "failed"):
                return
            with self._lock:
                if self._send_scheduled:
                    return
                self._send_scheduled = True
            self._worker.loop.call_later(_RESEND_SECONDS, self._send_snapshot)
            return
        stream.send({"op": STATE_OP, "seq": time.monotonic_ns(), **self.info()})
        with self._lock:
            self._sent_version = max(self._sent_version, version)

    def _set_state(self, state: str, error: str | None = None) -> None:
        with self._lock:
            if self._closed:
                return
            self.state = state
            if error is not None:
                self.error = error
        self._notify()

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
        concurrency = int(config.get("worker.load-concurrency", 1))
        try:
            if self.manifest is not None and self.level != "agnostic":
                # Outside the host's load slot: a copy waits on the network (peers, the
                # chunk directory), and must not keep the host's other loads waiting.
                self._fetch_template()
                if self.level == "full":
                    self._set_state(LOADING)
            with host_slot("context-load", concurrency):
                if self._closed:
                    return
                if self.manifest is None and self.level == "partial":
                    self._stage()
                elif self.level == "agnostic":
                    self.template_bytes = _source_bytes(self.context.template)
                if self.level == "full":
                    self._make_room(self.nbytes)
                    value = self._build(self.location)
                    nbytes = _size_of(value)
                    with self._lock:
                        if not self._closed:
                            self._value, value = value, None
                            self.nbytes = nbytes
                            self.last_used = time.monotonic()
                    if value is not None:  # torn down while loading
                        self._release(value, collect=True)
                        return
            with self._lock:
                if not self._closed:
                    self.state = READY
                    self.error = None
            self._notify()
            logger.info(
                "Context %r ready on %s (level %s)",
                self.context.name,
                self.worker_address,
                self.level,
            )
            if self.level == "full":
                self._make_room(0)
        except BaseException as exc:
            if self._closed:  # the worker is closing: the load was cut short, not broken
                logger.info(
                    "Load of context %r on %s abandoned at close (%s)",
                    self.context.name,
                    self.worker_address,
                    _describe(exc),
                )
                return
            self._set_state(FAILED, self._explain(exc))
            logger.error(
                "Context %r failed on %s: %s", self.context.name, self.worker_address, self.error
            )
        finally:
            self._event.set()

    def _explain(self, exc: BaseException) -> str:
        """The failure as the user should read it: a build from the worker's own copy of
        the template also names the user's source, where a damaged file must be fixed."""
        from dask_pcm.exceptions import ChunkError, TemplateFetchError

        text = _describe(exc)
        template = self.context.template
        if isinstance(exc, (ChunkError, TemplateFetchError)) or not self.location:
            return text  # the copy failed, not the build: its message says where and why
        if template and self.location != template:
            return f"{text} (building from {self.location!r}, this worker's copy of {template!r})"
        return f"{text} (building from {self.location!r})"

    def _fetch_template(self) -> None:
        """Get the template into worker-local disk from peers (else the source); serve it.

        A copy left by an earlier worker in the same folder is verified chunk by chunk
        before it is used or served, and fetched again if any chunk is wrong.
        """
        import shutil

        from dask_pcm.chunks import MANIFEST_NAME, Manifest, verify_copy
        from dask_pcm.exceptions import TemplateFetchError
        from dask_pcm.locks import file_lock
        from dask_pcm.p2p import TemplateStore

        assert self.manifest is not None
        manifest = Manifest.from_json(self.manifest)
        base = Path(self._template_dir)
        base.mkdir(parents=True, exist_ok=True)
        dest = base / manifest.digest[:16]
        store = TemplateStore.of(self._worker)
        with file_lock(base / f".{manifest.digest[:16]}.lock"):
            if (dest / MANIFEST_NAME).is_file() and manifest.digest not in store.held:
                bad = verify_copy(dest, manifest)
                if bad:
                    logger.warning(
                        "Local copy %s of the template of %r has %d chunk(s) that do not match "
                        "its manifest (e.g. %s): fetching it again",
                        dest,
                        self.context.name,
                        len(bad),
                        bad[:5],
                    )
                    shutil.rmtree(dest)
            if not (dest / MANIFEST_NAME).is_file():
                source, problem = self._source_root()
                loop = self._worker.loop.asyncio_loop  # type: ignore[attr-defined]
                future = asyncio.run_coroutine_threadsafe(self._fetch(manifest, dest, source), loop)
                try:
                    _, report = future.result()
                except TemplateFetchError as exc:
                    if not problem:
                        raise
                    raise TemplateFetchError(f"{exc}; the source: {problem}") from exc
                with self._lock:
                    self.bytes_from_peers += report.bytes_from_peers
                    self.bytes_from_source += report.bytes_from_source
                    self.corrupted_chunks += report.corrupted
                    self.fetch_seconds += report.seconds
                troubled = report.corrupted or report.failed_peers
                logger.log(
                    logging.WARNING if troubled else logging.INFO,
                    "Template of %r fetched on %s: %d bytes from peers, %d from the source, "
                    "%d corrupted chunk(s) discarded, %.2f s; peers: %s",
                    self.context.name,
                    self.worker_address,
                    report.bytes_from_peers,
                    report.bytes_from_source,
                    report.corrupted,
                    report.seconds,
                    report.describe_peers(),
                )
        store.add(dest, manifest)
        single = manifest.files[0].path if len(manifest.files) == 1 else ""
        with self._lock:
            self.template_digest = manifest.digest
            self.template_held = True
            self.template_bytes = manifest.total_bytes
            self.location = str(dest / single) if single.lower().endswith(".gguf") else str(dest)
        self._notify()

    def _source_root(self) -> tuple[str | None, str | None]:
        from dask_pcm.sources import resolve_source

        try:
            resolved = resolve_source(self.context.template)
        except Exception as exc:
            return None, _describe(exc)
        root = resolved.path.parent if resolved.kind == "gguf" else resolved.path
        return str(root), None

    async def _fetch(self, manifest: Any, dest: Path, source: str | None) -> Any:
        from dask_pcm.p2p import fetch_coordinated, fetch_template

        bandwidth = config.source_bandwidth()
        if config.get("template.peer-to-peer", True):
            return await fetch_coordinated(self._worker, manifest, dest, source, bandwidth)
        return await fetch_template(self._worker, manifest, dest, [], source, bandwidth)

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

    def _read_source(self) -> None:
        """Account one read of the template from the source (every build at ``agnostic``).

        Under a simulated shared filesystem (``pcm.template.source-bandwidth``) the read waits
        for its share of the host's link, chunk by chunk like a template copy, so a level
        ``agnostic`` run pays for its repeated reads as it would on a cluster's shared storage.
        """
        nbytes = self.template_bytes
        if not nbytes:
            return
        waited = 0.0
        bandwidth = config.source_bandwidth()
        if bandwidth is not None:
            chunk = int(dask.utils.parse_bytes(config.get("template.chunk-size")))
            for start in range(0, nbytes, chunk):
                waited += bandwidth.consume(min(chunk, nbytes - start))
        with self._lock:
            self.bytes_from_source += nbytes
            self.fetch_seconds += waited

    def _build(self, location: str) -> Any:
        start = time.perf_counter()
        value = self.context.loader(location)
        elapsed = time.perf_counter() - start
        with self._lock:
            self.loads += 1
            self.load_seconds += elapsed
            self.last_load_seconds = elapsed
            if self.device is None:
                self.device = describe_device(value)
            batch_size = getattr(value, "batch_size", None)
            self.batch_size = batch_size if isinstance(batch_size, int) else None
        self._notify()
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

    # -- memory budget ---------------------------------------------------------------------
    def _make_room(self, incoming: int) -> None:
        """Evict least recently used idle contexts until ``incoming`` more bytes fit."""
        limit = config.context_memory_limit()
        if limit is None:
            return
        with _budget_lock(self._worker):
            plugins = [p for p in context_plugins(self._worker).values() if p.level == "full"]
            used = sum(p.nbytes for p in plugins if p.state == READY) + incoming
            if used <= limit:
                return
            idle = sorted(
                (p for p in plugins if p is not self and p.state == READY and p.active == 0),
                key=lambda p: p.last_used,
            )
            for victim in idle:
                if used <= limit:
                    break
                freed = victim._evict()
                used -= freed
        if used > limit:
            logger.warning(
                "Contexts on %s use %d bytes, over pcm.worker.context-memory-limit (%d): "
                "the others are in use",
                self.worker_address,
                used,
                limit,
            )

    def _evict(self) -> int:
        """Drop the resident object if no task holds it; return the bytes freed."""
        with self._lock:
            if self.state != READY or self.active or self._value is None:
                return 0
            value, self._value = self._value, None
            self.state = EVICTED
            self.evictions += 1
            freed = self.nbytes
        self._event.clear()
        self._notify()
        self._release(value, collect=True)
        logger.info(
            "Evicted context %r on %s (%d bytes, least recently used)",
            self.context.name,
            self.worker_address,
            freed,
        )
        return freed

    # -- used by tasks ---------------------------------------------------------------------
    def wait_ready(self, timeout: float | None) -> None:
        """Block until the context is ready here; raise if it failed, closed or timed out.

        An evicted context is rebuilt first.
        """
        with self._lock:
            rebuild = self.state == EVICTED and not self._closed
            if rebuild:
                self.state = LOADING
        if rebuild:
            logger.info(
                "Rebuilding evicted context %r on %s", self.context.name, self.worker_address
            )
            self._notify()
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
            with self._lock:
                if self.state == READY:
                    self.active += 1
                    self.last_used = time.monotonic()
                    value = self._value
                    break
            if deadline is None:
                seconds = config.ready_timeout() if timeout == "configured" else timeout
                if seconds is None:
                    self.wait_ready(None)
                    continue
                deadline = time.monotonic() + float(seconds)
            self.wait_ready(max(0.0, deadline - time.monotonic()))
        if self.level == "full":
            return value, False
        try:
            if self.level == "agnostic":
                self._read_source()
            return self._build(self.location), True
        except BaseException as exc:
            with self._lock:
                self.active -= 1
            raise ContextLoadError(
                f"context {self.context.name!r} failed to load on worker "
                f"{self.worker_address}: {self._explain(exc)}",
                {self.worker_address: self._explain(exc)},
            ) from exc

    def done(self, value: Any, owned: bool) -> None:
        """Count a served task and drop a per-task object."""
        with self._lock:
            self.tasks += 1
            self.active -= 1
            self.last_used = time.monotonic()
        if owned:
            self._release(value)

    def info(self) -> dict[str, Any]:
        """One status row for this worker and context, as the worker sees it."""
        with self._lock:
            return {
                "worker": self.worker_address,
                "context": self.context.name,
                "state": self.state,
                "level": self.level,
                "loads": self.loads,
                "load_seconds": round(self.load_seconds, 6),
                "last_load_seconds": round(self.last_load_seconds, 6),
                "evictions": self.evictions,
                "tasks": self.tasks,
                "nbytes": self.nbytes,
                "device": self.device,
                "batch_size": self.batch_size,
                "template": self.context.template,
                "location": self.location,
                "template_bytes": self.template_bytes,
                "template_digest": self.template_digest,
                "template_held": self.template_held,
                "bytes_from_peers": self.bytes_from_peers,
                "bytes_from_source": self.bytes_from_source,
                "corrupted_chunks": self.corrupted_chunks,
                "fetch_seconds": round(self.fetch_seconds, 6),
                "error": self.error,
            }


def _source_bytes(template: Any) -> int:
    """Bytes one build reads from a local template source; 0 for hub ids and custom sources."""
    from dask_pcm.sources import resolve_source, template_files

    if not isinstance(template, str) or not (template == "embedded" or os.path.exists(template)):
        return 0
    try:
        return sum(p.stat().st_size for p in template_files(resolve_source(template)))
    except Exception:  # the build itself reports an unusable source, with its reason
        return 0


def _size_of(value: Any) -> int:
    nbytes = getattr(value, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes
    from dask.sizeof import sizeof

    return int(sizeof(value))


def describe_device(value: Any) -> str | None:
    """Where a context lives, for status: ``cpu (8 threads, <CPU model>)`` or the GPU."""
    device = getattr(value, "device", None)
    if device is None:
        return None
    text = str(device)
    torch = sys.modules.get("torch")
    if text.startswith("cuda") and torch is not None and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.device(text))
        return f"{text} ({props.name}, {props.total_memory / 2**30:.1f} GiB)"
    if text == "cpu":
        threads = torch.get_num_threads() if torch is not None else os.cpu_count()
        return f"cpu ({threads} threads, {_cpu_model()})"
    return text


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def context_plugins(worker: Worker) -> dict[str, ContextPlugin]:
    """The context plugins set up on ``worker``, by context name."""
    return {
        p.context.name: p
        for p in list(worker.plugins.values())  # a snapshot: load threads call this too
        if isinstance(p, ContextPlugin) and hasattr(p, "state")
    }
