"""What the plugins say to each other: context states, the status record, handler names.

One place for the vocabulary the worker plugin, the scheduler plugin, the client and the
dashboard share, so that none of them imports another for it.

The status record, :class:`ContextStatus`, is the one schema of a context on a worker: its
fields, in order, are the columns of :func:`dask_pcm.status`, of the rows of
``/pcm/status.json`` and of what a worker reports. A worker sends every field but those the
scheduler keeps itself (:data:`SCHEDULER_FIELDS`: time in state, tasks counted from the
scheduler's transitions).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Protocol, runtime_checkable

# States of a context on one worker (WORKER_TRANSITIONS says which change to which):
#   fetching -> loading -> ready -> evicted -> loading;  fetching, loading -> failed;
#   any -> closed.  The scheduler's record starts at absent (no report yet).
ABSENT = "absent"  # connected, no report yet (the scheduler's own state)
FETCHING = "fetching"  # copying the template to the worker's disk
LOADING = "loading"  # building the context
READY = "ready"
FAILED = "failed"
EVICTED = "evicted"  # freed under the memory budget; rebuilt on demand
CLOSED = "closed"  # unregistered, or the worker is closing
STATES = (ABSENT, FETCHING, LOADING, READY, FAILED, EVICTED, CLOSED)

#: The states a worker plugin starts in: ``fetching`` when it copies the template first.
WORKER_START = (FETCHING, LOADING)
#: What one worker plugin's context may change to from each state, at any level
#: (:mod:`dask_pcm.worker.levels` narrows it per level; the scheduler's table,
#: :data:`dask_pcm.scheduler.state.TRANSITIONS`, is derived from it). ``closed`` is final.
WORKER_TRANSITIONS: dict[str, frozenset[str]] = {
    FETCHING: frozenset({LOADING, READY, FAILED, CLOSED}),
    LOADING: frozenset({READY, FAILED, CLOSED}),
    READY: frozenset({EVICTED, CLOSED}),
    EVICTED: frozenset({LOADING, CLOSED}),
    FAILED: frozenset({CLOSED}),
    CLOSED: frozenset(),
}

#: How the pages and Jupyter colour each state (``/pcm/status`` has the same in its CSS).
STATE_COLOURS = {
    READY: "#2e9d4e",
    FETCHING: "#d08a1a",
    LOADING: "#d08a1a",
    FAILED: "#c8372d",
    EVICTED: "#7a7a7a",
    ABSENT: "#aaaaaa",
    CLOSED: "#aaaaaa",
}

#: Worker plugins are registered under this prefix followed by the context's name.
PLUGIN_PREFIX = "dask-pcm-context-"


def plugin_name(context_name: str) -> str:
    """Name under which the worker plugin for ``context_name`` is registered."""
    return PLUGIN_PREFIX + context_name


@runtime_checkable
class ContextSource(Protocol):
    """What a context task asks of the worker plugin of one context.

    :class:`dask_pcm.worker.ContextPlugin` is one; :mod:`dask_pcm.tasks` finds it in
    ``worker.plugins`` under :func:`plugin_name` and needs nothing else of the worker side,
    so the task marker (imported by the scheduler) does not import the worker's stack.
    ``state`` is only there once the plugin is set up on the worker.
    """

    @property
    def state(self) -> str:
        """The context's state on this worker (one of :data:`STATES`)."""
        ...

    def acquire(self) -> tuple[Any, bool]:
        """The object for one task, and whether the task owns it (releases it after)."""
        ...

    def done(self, value: Any, owned: bool) -> None:
        """The task is done with ``value``."""
        ...


# The worker plugin's report, over the worker's batched stream (ordered with task results).
STATE_OP = "pcm-context-state"
# Worker handler: one chunk of a template the worker holds.
CHUNK_OP = "pcm_template_chunk"
# Scheduler handlers: the chunk directory and the adaptive keep rule.
CHUNK_PLAN_OP = "pcm_chunk_plan"
CHUNK_HAVE_OP = "pcm_chunk_have"
KEEP_WORKERS_OP = "pcm_keep_workers"
# Scheduler handler: register()'s wait until its contexts are ready or failed everywhere.
SETTLE_OP = "pcm_settle"

#: Task annotation (``dask.annotate(**{LOSSES_ANNOTATION: n})``): the task errs with
#: :class:`~distributed.scheduler.KilledWorker` once ``n`` workers died running it, instead
#: of after ``distributed.scheduler.allowed-failures`` + 1. A client that can split its work
#: (:mod:`dask_pcm.batch.dispatch`) asks for 1: after the first loss it runs the task's rows
#: apart, so that one row that kills workers costs its own row, not its neighbours' or a
#: restart loop of the cluster.
LOSSES_ANNOTATION = "pcm_losses"
#: Key prefix of the batch layer's tasks (annotated with :data:`LOSSES_ANNOTATION`).
SPLITTABLE_PREFIX = "pcm-"

_KEPT_BY_SCHEDULER = {"kept_by": "scheduler"}


@dataclass
class ContextStatus:
    """One context on one worker: a row of :func:`dask_pcm.status`.

    Attributes
    ----------
    worker, context
        The worker's address and the context's name.
    state
        One of :data:`STATES` (``failed``: ``error`` says why).
    level
        ``full``, ``partial`` or ``agnostic``.
    state_seconds
        Time in ``state`` so far (kept by the scheduler).
    loads, load_seconds, last_load_seconds
        Builds of the context on this worker and their time.
    tasks, task_errors
        Context tasks that finished on this worker, and those that raised (kept by the
        scheduler, from its own transitions).
    evictions
        Times the resident context was freed under ``pcm.worker.context-memory-limit``.
    nbytes
        Size of the resident context.
    prefix_cache_bytes
        Memory its kept prompt-prefix states take (``pcm.worker.prefix-cache``).
    device, dtype, batch_size
        Where it lives (``cpu (2 threads, <CPU>)``, ``cuda:0 (<GPU>, <memory>)``), the dtype
        of its weights, and the prompts per forward pass the loader chose (smaller after an
        out-of-memory error).
    template, location
        What the user named, and what the loader reads (the worker's own copy).
    template_bytes, template_digest, template_held
        Size and digest of the template, and whether this worker holds (and serves) a
        complete copy.
    bytes_from_peers, bytes_from_source, corrupted_chunks, fetch_seconds
        Where the template's bytes came from, chunks discarded as corrupted, copy time.
    warning
        Something about this worker's context the user should know though it works, e.g. a
        GPU that this worker's torch cannot use (the context runs on the CPU).
    error
        The last failure, as the user should read it.
    """

    worker: str
    context: str
    state: str = ABSENT
    level: str = ""
    state_seconds: float = field(default=0.0, metadata=_KEPT_BY_SCHEDULER)
    loads: int = 0
    load_seconds: float = 0.0
    last_load_seconds: float = 0.0
    tasks: int = field(default=0, metadata=_KEPT_BY_SCHEDULER)
    task_errors: int = field(default=0, metadata=_KEPT_BY_SCHEDULER)
    evictions: int = 0
    nbytes: int = 0
    prefix_cache_bytes: int = 0
    device: str | None = None
    dtype: str | None = None
    batch_size: int | None = None
    template: str | None = None
    location: str | None = None
    template_bytes: int = 0
    template_digest: str | None = None
    template_held: bool = False
    bytes_from_peers: int = 0
    bytes_from_source: int = 0
    corrupted_chunks: int = 0
    fetch_seconds: float = 0.0
    warning: str | None = None
    error: str | None = None

    def row(self) -> dict[str, Any]:
        """The record as a status row (:data:`COLUMNS`, in order)."""
        return {c: _rounded(getattr(self, c)) for c in COLUMNS}

    def report(self) -> dict[str, Any]:
        """What a worker sends: every field the scheduler does not keep itself."""
        return {c: _rounded(getattr(self, c)) for c in REPORTED}


def _rounded(value: Any) -> Any:
    return round(value, 6) if isinstance(value, float) else value


COLUMNS: tuple[str, ...] = tuple(f.name for f in fields(ContextStatus))
"""The status columns, in order."""

SCHEDULER_FIELDS: tuple[str, ...] = tuple(
    f.name for f in fields(ContextStatus) if f.metadata.get("kept_by") == "scheduler"
)
REPORTED: tuple[str, ...] = tuple(c for c in COLUMNS if c not in SCHEDULER_FIELDS)
