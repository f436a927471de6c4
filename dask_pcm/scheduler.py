"""The scheduler side: where each context is ready, and context tasks sent only there.

:class:`ContextScheduler` is a :class:`distributed.SchedulerPlugin` that
:func:`dask_pcm.register` installs before any context. It keeps, per worker and context,
a state machine driven by the snapshots the worker plugins send over their batched
streams::

    absent -> fetching -> loading -> ready
                  \\           \\-> failed
                   \\-> failed     ready -> evicted -> loading -> ready

(``absent``: the worker is connected but has not reported yet.) Every entry keeps the
time it entered its state and a short history, so status shows durations.

Placement: restrictions, not resources
--------------------------------------
Tasks whose function is a :class:`~dask_pcm.tasks.ContextTask` get worker restrictions in
``update_graph``, before the scheduler places them. All tasks that need the same set of
contexts share *one* restriction set object, which this plugin updates in place when a
worker's state changes: one set operation per state change, however many tasks wait.
Worker resources were the alternative; they were not chosen because a resource also caps
how many tasks run at once, a task that requires a resource no worker has can never fall
back (``allow_other_workers`` only loosens worker and host restrictions), and a worker
that lost a resource (eviction) would keep tasks it can no longer run. Work stealing
honours worker restrictions (``WorkStealing._get_thief``), so a stolen task only moves to
another worker in the set. A task submitted with explicit ``workers=`` keeps them.

In the steady state, when every connected worker has the task's contexts ready, no
restriction is needed and none is set: Dask places (and queues) those tasks exactly like
plain ones, at no extra cost. The moment a worker is not ready (one joins, fails, is evicted),
the plugin gives every such task that has not run yet the shared set, before the scheduler
can offer the newcomer any work; tasks waiting in Dask's queue, which ignores restrictions,
are taken out and placed again.

The set holds the workers where every needed context is ``ready``; when there are none,
those where it was ``evicted`` (they rebuild it on demand); else nobody, and the tasks wait
in ``no-worker`` until a worker becomes ready. When every connected worker has *failed* to
build a context, its waiting tasks err at once with the loaders' messages
(:class:`~dask_pcm.ContextLoadError`) instead of waiting forever. Tasks with
``allow_other_workers=True`` have loose restrictions: with no worker in the set, the
scheduler may place them anywhere, and that worker waits for (or rebuilds) the context.

Tasks served are counted here, from the scheduler's own transitions (a context task that
finished on a worker, or erred there), so status costs nothing per task on the workers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from distributed import SchedulerPlugin

from dask_pcm.exceptions import ContextLoadError, ContextNotFoundError, ContextTimeoutError
from dask_pcm.tasks import ContextTask
from dask_pcm.worker import EVICTED, FAILED, FETCHING, LOADING, READY, STATE_OP

if TYPE_CHECKING:
    from distributed import Scheduler

logger = logging.getLogger(__name__)

PLUGIN_NAME = "dask-pcm"
ABSENT = "absent"
UNKNOWN = "unknown"
_HOPELESS = (FAILED, UNKNOWN)
_HISTORY = 16
# A restriction set is never empty (empty means "unrestricted" to the scheduler): this
# address, which no worker has, keeps it restricting when no worker qualifies.
_NOBODY = "dask-pcm://no-worker-with-context"
# Chunks one worker may be reading from a template's source at once, and how long such a
# lease lasts before another worker may take the chunk.
_SOURCE_LEASES = 2
_LEASE_SECONDS = 120.0

# Columns of a status row, in order (dask_pcm.status and /pcm/status.json).
STATUS_COLUMNS = [
    "worker",
    "context",
    "state",
    "level",
    "state_seconds",
    "loads",
    "load_seconds",
    "last_load_seconds",
    "tasks",
    "task_errors",
    "evictions",
    "nbytes",
    "device",
    "batch_size",
    "template",
    "location",
    "template_bytes",
    "template_digest",
    "template_held",
    "bytes_from_peers",
    "bytes_from_source",
    "corrupted_chunks",
    "fetch_seconds",
    "error",
]


@dataclass
class Placement:
    """One context on one worker, as the scheduler knows it."""

    worker: str
    context: str
    level: str
    state: str = ABSENT
    since: float = field(default_factory=time.time)
    history: list[tuple[str, float]] = field(default_factory=list)
    seq: int = -1
    loads: int = 0
    load_seconds: float = 0.0
    last_load_seconds: float = 0.0
    evictions: int = 0
    nbytes: int = 0
    device: str | None = None
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
    error: str | None = None
    tasks: int = 0
    task_errors: int = 0

    def __post_init__(self) -> None:
        self.history.append((self.state, self.since))

    def move(self, state: str, now: float) -> None:
        if state == self.state:
            return
        self.state = state
        self.since = now
        self.history.append((state, now))
        del self.history[:-_HISTORY]

    def row(self, now: float) -> dict[str, Any]:
        """The status row: :data:`STATUS_COLUMNS`, in order."""
        return {
            c: round(now - self.since, 3) if c == "state_seconds" else getattr(self, c)
            for c in STATUS_COLUMNS
        }


# What a worker's snapshot sets on its Placement: every status column but those the
# scheduler keeps itself (identity, state and its age, tasks counted from transitions).
_REPORTED = tuple(
    c
    for c in STATUS_COLUMNS
    if c not in ("worker", "context", "state", "level", "state_seconds", "tasks", "task_errors")
)


class ContextScheduler(SchedulerPlugin):
    """Track contexts per worker and steer context tasks to workers where they are ready.

    Installed by :func:`dask_pcm.register`; one per scheduler. See the module docstring for
    the state machine and the placement rules.
    """

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self) -> None:
        self.levels: dict[str, str] = {}
        self.placements: dict[str, dict[str, Placement]] = {}
        # Shared restriction set per combination of contexts a task needs.
        self._allowed: dict[tuple[str, ...], set[str]] = {}
        self._needs: dict[Any, tuple[str, ...]] = {}
        # Context tasks left unrestricted because every worker was ready when they came.
        self._free: dict[Any, tuple[str, ...]] = {}
        # Chunk directory of templates being copied: who holds which chunk, and which
        # worker is reading which chunk from the source (a lease, with its expiry).
        self.chunk_holders: dict[str, dict[int, set[str]]] = {}
        self.source_leases: dict[str, dict[int, tuple[str, float]]] = {}
        # Workers that served a chunk failing verification: not offered for it again.
        self.bad_holders: dict[str, dict[int, set[str]]] = {}
        # Load durations observed (for the Prometheus histogram), per context.
        self.load_durations: dict[str, list[float]] = {}
        self.scheduler: Scheduler | None = None

    # -- plugin hooks ----------------------------------------------------------------------
    async def start(self, scheduler: Scheduler) -> None:
        from tornado.ioloop import PeriodicCallback

        self.scheduler = scheduler
        scheduler.stream_handlers[STATE_OP] = self._on_state
        scheduler.handlers["pcm_template_sources"] = self.template_sources
        scheduler.handlers["pcm_chunk_plan"] = self.chunk_plan
        scheduler.handlers["pcm_chunk_have"] = self.chunk_have
        scheduler.handlers["pcm_keep_workers"] = self.keep_workers
        self._stuck_check = PeriodicCallback(self._fail_stuck, 1000)
        self._stuck_check.start()
        from dask_pcm import dashboard

        dashboard.install(self)

    async def close(self) -> None:
        if self.scheduler is not None:
            self.scheduler.stream_handlers.pop(STATE_OP, None)
            for handler in ("pcm_template_sources", "pcm_chunk_plan", "pcm_chunk_have"):
                self.scheduler.handlers.pop(handler, None)
            self._stuck_check.stop()
        from dask_pcm import dashboard

        dashboard.uninstall(self)

    def add_worker(self, scheduler: Scheduler, worker: str) -> None:
        for name, level in self.levels.items():
            self.placements[name].setdefault(worker, Placement(worker, name, level))
        # Runs before the scheduler offers the new worker any task: restrict the free
        # context tasks now, so none goes to a worker that has not loaded its context.
        self._refresh(list(self.levels), stimulus_id=f"pcm-add-worker-{time.time()}")

    def remove_worker(self, scheduler: Scheduler, worker: str, **kwargs: Any) -> None:
        for directory in (self.chunk_holders, self.bad_holders):
            for holders in directory.values():
                for who in holders.values():
                    who.discard(worker)
        for leases in self.source_leases.values():
            for index in [i for i, (w, _) in leases.items() if w == worker]:
                del leases[index]
        changed = [name for name, by in self.placements.items() if by.pop(worker, None)]
        if changed:
            self._refresh(changed, stimulus_id=f"pcm-remove-worker-{time.time()}")

    def update_graph(self, scheduler: Scheduler, *, tasks: list[Any], **kwargs: Any) -> None:
        seen: set[tuple[str, ...]] = set()
        all_ready: dict[tuple[str, ...], bool] = {}  # once per combination, not per task
        for key in tasks:
            ts = scheduler.tasks.get(key)
            func = getattr(getattr(ts, "run_spec", None), "func", None)
            if ts is None or not isinstance(func, ContextTask):
                continue
            names = func.names
            self._needs[key] = names
            seen.add(names)
            if ts.worker_restrictions or ts.host_restrictions:
                continue  # the user chose workers explicitly
            if names not in all_ready:
                all_ready[names] = self._all_ready(names)
            if all_ready[names]:
                # The steady state: no restriction needed, so Dask places (and queues) these
                # exactly like plain tasks. Restricted the moment a worker is not ready.
                self._free[key] = names
                continue
            ts.worker_restrictions = self._allowed_for(names)
            ts.loose_restrictions = func.allow_other_workers
        hopeless = {n for names in seen for n in names if self._eligible(n)[1] in _HOPELESS}
        if hopeless:
            # The new tasks reach "no-worker" only after this hook returns.
            asyncio.get_running_loop().call_soon(
                self._fail_waiting, hopeless, f"pcm-context-failed-{time.time()}"
            )

    def transition(
        self, key: Any, start: str, finish: str, *args: Any, stimulus_id: str, **kwargs: Any
    ) -> None:
        names = self._needs.get(key)
        if names is None:
            return
        if start == "processing" and finish in ("memory", "erred"):
            worker = kwargs.get("worker")
            for name in names:
                placement = self.placements.get(name, {}).get(worker)  # type: ignore[arg-type]
                if placement is not None:
                    if finish == "memory":
                        placement.tasks += 1
                    else:
                        placement.task_errors += 1
        elif finish == "forgotten":
            del self._needs[key]
            self._free.pop(key, None)

    # -- declarations (from dask_pcm.register / unregister) ---------------------------------
    def declare(self, name: str, level: str) -> None:
        """A context was registered: expect a report from every worker."""
        assert self.scheduler is not None
        self.levels[name] = level
        by_worker = self.placements.setdefault(name, {})
        for worker in self.scheduler.workers:
            current = by_worker.get(worker)
            if current is None or current.level != level:
                by_worker[worker] = Placement(worker, name, level)
        self._refresh([name], stimulus_id=f"pcm-declare-{time.time()}")

    def forget(self, name: str) -> None:
        """A context was unregistered: its waiting tasks err, its state goes."""
        self.levels.pop(name, None)
        self.placements.pop(name, None)
        self.load_durations.pop(name, None)
        self._refresh([name], stimulus_id=f"pcm-forget-{time.time()}")

    # -- state reports from workers ---------------------------------------------------------
    def _on_state(self, worker: str, context: str, state: str, seq: int, **info: Any) -> None:
        assert self.scheduler is not None
        by_worker = self.placements.get(context)
        if by_worker is None or worker not in self.scheduler.workers:
            return  # unregistered meanwhile, or a late message from a removed worker
        placement = by_worker.get(worker)
        if placement is None:
            placement = by_worker[worker] = Placement(worker, context, info.get("level", ""))
        if seq <= placement.seq:
            return
        placement.seq = seq
        loads_before = placement.loads
        for attr in _REPORTED:
            if attr in info:
                setattr(placement, attr, info[attr])
        if placement.loads > loads_before and placement.level == "full":
            self.load_durations.setdefault(context, []).append(placement.last_load_seconds)
        previous = placement.state
        placement.move(state, time.time())
        if previous != placement.state:
            self._refresh([context], stimulus_id=f"pcm-{state}-{time.time()}")

    # -- placement -------------------------------------------------------------------------
    def _eligible(self, name: str) -> tuple[set[str], str]:
        """Workers that may run tasks needing ``name`` now, and why.

        The reason is ``ready``, ``evicted`` (rebuilt on demand), ``wait`` (loading, or no
        report yet, or no workers), ``failed`` (failed on every connected worker) or
        ``unknown`` (not registered).
        """
        if name not in self.levels:
            return set(), UNKNOWN
        by_worker = self.placements.get(name, {})
        ready = {w for w, p in by_worker.items() if p.state == READY}
        if ready:
            return ready, READY
        evicted = {w for w, p in by_worker.items() if p.state == EVICTED}
        if evicted:
            return evicted, EVICTED
        if by_worker and all(p.state == FAILED for p in by_worker.values()):
            return set(), FAILED
        return set(), "wait"

    def _all_ready(self, names: tuple[str, ...]) -> bool:
        """Whether every connected worker has all of ``names`` ready."""
        assert self.scheduler is not None
        workers = self.scheduler.workers
        for name in names:
            by_worker = self.placements.get(name)
            if not by_worker or len(by_worker) < len(workers):
                return False
            if any(p.state != READY for p in by_worker.values()):
                return False
        return bool(workers)

    def _restrict_free(self, names: set[str], stimulus_id: str) -> None:
        """Give the free tasks needing any of ``names`` their restriction sets.

        Queued tasks leave Dask's queue (which ignores restrictions) and are placed again.
        """
        assert self.scheduler is not None
        recs: dict[Any, Any] = {}
        for key, combo in list(self._free.items()):
            if not names.intersection(combo):
                continue
            del self._free[key]
            ts = self.scheduler.tasks.get(key)
            if ts is None or ts.state in ("memory", "erred", "forgotten"):
                continue
            func = getattr(ts.run_spec, "func", None)
            ts.worker_restrictions = self._allowed_for(combo)
            ts.loose_restrictions = bool(getattr(func, "allow_other_workers", False))
            if ts.state == "queued":
                recs[key] = "released"
        if recs:
            # Released tasks that are still wanted go back to waiting, then to a worker in
            # their restriction set (or no-worker).
            self.scheduler.transitions(recs, stimulus_id)

    def _allowed_for(self, names: tuple[str, ...]) -> set[str]:
        allowed = self._allowed.get(names)
        if allowed is None:
            allowed = self._allowed[names] = {_NOBODY}
            self._update_allowed(names, allowed)
        return allowed

    def _update_allowed(self, names: tuple[str, ...], allowed: set[str]) -> None:
        workers: set[str] | None = None
        for name in names:
            eligible = self._eligible(name)[0]
            workers = eligible if workers is None else workers & eligible
        allowed.clear()
        allowed.add(_NOBODY)
        allowed.update(workers or ())

    def _refresh(self, names: Iterable[str], stimulus_id: str) -> None:
        """Recompute the restriction sets that involve ``names``; wake or fail waiters."""
        assert self.scheduler is not None
        names = set(names)
        if self._free:
            not_ready = {n for n in names if not self._all_ready((n,))}
            if not_ready:
                self._restrict_free(not_ready, stimulus_id)
        touched = False
        for combo, allowed in self._allowed.items():
            if names.intersection(combo):
                self._update_allowed(combo, allowed)
                touched = True
        if touched:
            recs: dict[Any, Any] = {}
            for ts in self.scheduler.unrunnable:
                needs = self._needs.get(ts.key)
                if needs and names.intersection(needs) and self.scheduler.valid_workers(ts):
                    recs[ts.key] = "processing"
            if recs:
                self.scheduler.transitions(recs, stimulus_id)
        hopeless = {n for n in names if self._eligible(n)[1] in _HOPELESS}
        if hopeless:
            self._fail_waiting(hopeless, stimulus_id)

    def _fail_waiting(self, names: set[str], stimulus_id: str) -> None:
        """Err the waiting tasks of contexts that failed on every worker or are unknown."""
        for name in names:
            reason = self._eligible(name)[1]
            if reason == UNKNOWN:
                known = sorted(self.levels) or "none"
                missing = ContextNotFoundError(
                    f"context {name!r} is not registered (registered: {known}); "
                    "call dask_pcm.register(client, context) first"
                )
                self._err_unrunnable(lambda combo, n=name: n in combo, missing, stimulus_id)
                continue
            if reason != FAILED:
                continue
            failures = {w: p.error or "" for w, p in self.placements[name].items()}
            lines = [f"context {name!r} failed on every worker ({len(failures)}):"]
            lines += [f"  {w}: {msg}" for w, msg in sorted(failures.items())]
            exc = ContextLoadError("\n".join(lines), failures)
            self._err_unrunnable(lambda combo, n=name: n in combo, exc, stimulus_id)

    def _fail_stuck(self) -> None:
        """Err tasks waiting for a context that no worker finished loading in time.

        Applies ``pcm.worker.ready-timeout`` on the scheduler: when every worker that has
        the context has been absent, fetching or loading for longer than that, its waiting
        tasks err with :class:`~dask_pcm.ContextTimeoutError`. With no workers at all (jobs
        still queued on a batch system) tasks keep waiting.
        """
        from dask_pcm import config

        timeout = config.ready_timeout()
        if timeout is None or self.scheduler is None or not self.scheduler.unrunnable:
            return
        now = time.time()
        for name, by_worker in list(self.placements.items()):
            if not by_worker or any(
                p.state not in (ABSENT, FETCHING, LOADING) or now - p.since <= timeout
                for p in by_worker.values()
            ):
                continue
            detail = ", ".join(
                f"{w} {p.state} for {now - p.since:.0f} s" for w, p in sorted(by_worker.items())
            )
            exc = ContextTimeoutError(
                f"context {name!r} not ready on any worker after {timeout:g} s "
                f"(pcm.worker.ready-timeout): {detail}"
            )
            self._err_unrunnable(lambda combo, n=name: n in combo, exc, f"pcm-stuck-{now}")

    def _err_unrunnable(self, needs: Any, exc: BaseException, stimulus_id: str) -> None:
        from distributed.protocol.pickle import dumps

        assert self.scheduler is not None
        doomed = [
            ts.key
            for ts in self.scheduler.unrunnable
            if ts.key in self._needs and needs(self._needs[ts.key]) and not ts.loose_restrictions
        ]
        if not doomed:
            return
        payload = dumps(exc)
        for key in doomed:
            self.scheduler.transition(
                key,
                "erred",
                stimulus_id=stimulus_id,
                cause=key,
                exception=payload,
                exception_text=str(exc),
                traceback=None,
                traceback_text="",
            )
        logger.warning("%d waiting task(s) erred: %s", len(doomed), str(exc).splitlines()[0])

    def template_sources(self, digest: str) -> list[str]:
        """RPC handler: workers holding the whole template ``digest``, in random order.

        A worker becomes a source the moment its copy is complete, before its context is
        built, so capacity grows as workers join (the order spreads the requests).
        """
        import random

        assert self.scheduler is not None
        holders = {
            w
            for by_worker in self.placements.values()
            for w, p in by_worker.items()
            if p.template_held and p.template_digest == digest and w in self.scheduler.workers
        }
        order = sorted(holders)
        random.shuffle(order)
        return order

    def chunk_plan(self, digest: str, worker: str, missing: list[int]) -> dict[str, Any]:
        """RPC handler: where ``worker`` should get each of its ``missing`` chunks now.

        Returns ``{"peers": {index: [workers]}, "source": [indexes]}``: peers (whole copies
        and partial ones) for every chunk someone holds, in random order; and a source lease
        for chunks nobody holds or is reading, at most ``_SOURCE_LEASES`` per worker at once,
        so workers that start together split the source between them. A lease lapses after
        ``_LEASE_SECONDS`` or when its worker leaves.
        """
        import random

        assert self.scheduler is not None
        now = time.time()
        whole = set(self.template_sources(digest))
        holders = self.chunk_holders.setdefault(digest, {})
        bad = self.bad_holders.get(digest, {})
        leases = self.source_leases.setdefault(digest, {})
        for index in [i for i, (_, until) in leases.items() if until < now]:
            del leases[index]
        mine = sum(1 for w, _ in leases.values() if w == worker)
        peers: dict[int, list[str]] = {}
        source: list[int] = []
        for index in missing:
            who = sorted((holders.get(index, set()) | whole) - bad.get(index, set()) - {worker})
            if who:
                random.shuffle(who)
                peers[index] = who
            elif index not in leases and mine < _SOURCE_LEASES:
                leases[index] = (worker, now + _LEASE_SECONDS)
                source.append(index)
                mine += 1
        return {"peers": peers, "source": source}

    def chunk_have(
        self,
        digest: str,
        worker: str,
        indexes: list[int],
        released: list[int] | None = None,
        lost: list[int] | None = None,
        bad: list[int] | None = None,
    ) -> None:
        """RPC handler: ``worker`` now holds ``indexes``; its leases on ``released`` end;
        it no longer offers ``lost`` (it failed to serve them, or gave up its copy); it
        served ``bad`` with the wrong bytes, so nobody is sent to it for them again."""
        if self.scheduler is None or worker not in self.scheduler.workers:
            return
        holders = self.chunk_holders.setdefault(digest, {})
        leases = self.source_leases.setdefault(digest, {})
        for index in lost or ():
            holders.get(index, set()).discard(worker)
        if bad:
            marked = self.bad_holders.setdefault(digest, {})
            first = not any(worker in who for who in marked.values())
            for index in bad:
                marked.setdefault(index, set()).add(worker)
            if first:  # once per worker and template: its copy is damaged
                logger.warning(
                    "%s served corrupted chunk(s) %s of template %s...: no longer offered for them",
                    worker,
                    bad,
                    digest[:12],
                )
        for index in indexes:
            holders.setdefault(index, set()).add(worker)
            leases.pop(index, None)
        for index in released or ():
            if leases.get(index, ("", 0.0))[0] == worker:
                del leases[index]

    # -- adaptive scaling ----------------------------------------------------------------
    def keep_workers(self, names: list[Any]) -> list[Any]:
        """RPC handler: of the workers named ``names`` (to be retired), those to keep.

        For every context that unfinished context tasks wait for, if every worker with that
        context ready is about to go, one of them stays: retiring them all would make the
        waiting tasks wait for a new worker's load (or forever, with no worker left).
        """
        assert self.scheduler is not None
        by_name = {ws.name: addr for addr, ws in self.scheduler.workers.items()}
        leaving = {by_name[n] for n in names if n in by_name}
        waiting: set[str] = set()
        for key, needs in self._needs.items():
            ts = self.scheduler.tasks.get(key)
            if ts is not None and ts.state not in ("memory", "erred", "forgotten"):
                waiting.update(needs)
        keep: set[str] = set()
        for name in sorted(waiting):
            ready = {w for w, p in self.placements.get(name, {}).items() if p.state == READY}
            if ready and ready <= leaving and not ready & keep:
                keep.add(min(ready))
        return [self.scheduler.workers[addr].name for addr in sorted(keep)]

    # -- reading ---------------------------------------------------------------------------
    def rows(self, contexts: Iterable[str] | None = None) -> list[dict[str, Any]]:
        """Status rows, sorted by context then worker."""
        wanted = None if contexts is None else set(contexts)
        now = time.time()
        return [
            p.row(now)
            for name in sorted(self.placements)
            if wanted is None or name in wanted
            for _, p in sorted(self.placements[name].items())
        ]

    def summary(self) -> dict[str, dict[str, Any]]:
        """Per context: level, workers per state, tasks served, waiting tasks."""
        waiting: dict[str, int] = {}
        if self.scheduler is not None:
            for ts in self.scheduler.unrunnable:
                for name in self._needs.get(ts.key, ()):
                    waiting[name] = waiting.get(name, 0) + 1
        out = {}
        for name, by_worker in sorted(self.placements.items()):
            states: dict[str, int] = {}
            for p in by_worker.values():
                states[p.state] = states.get(p.state, 0) + 1
            out[name] = {
                "level": self.levels.get(name),
                "workers": states,
                "tasks": sum(p.tasks for p in by_worker.values()),
                "waiting_tasks": waiting.get(name, 0),
            }
        return out


def get_plugin(scheduler: Scheduler) -> ContextScheduler:
    """The :class:`ContextScheduler` installed on ``scheduler``."""
    plugin = scheduler.plugins.get(PLUGIN_NAME)
    if not isinstance(plugin, ContextScheduler):
        raise ContextNotFoundError(
            "dask_pcm's scheduler plugin is not installed on this scheduler: "
            "call dask_pcm.register(client, context) first"
        )
    return plugin
