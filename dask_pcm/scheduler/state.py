"""What the scheduler knows of every context on every worker.

:class:`ContextStates` keeps one :class:`Placement` (the status record of
:mod:`dask_pcm.protocol` plus the time it entered its state and a short history) per worker
and context, driven by the workers' reports and by the scheduler's own task transitions.
:meth:`Placement.move` is the one transition function: it refuses what :data:`TRANSITIONS`
does not allow, and :meth:`ContextStates.report` drops (and logs) a report that asks for
that. It answers the questions placement asks (where is a context ready? has it failed everywhere?)
and reads out status rows and summaries.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from dask_pcm.exceptions import TransitionError
from dask_pcm.protocol import (
    ABSENT,
    CLOSED,
    EVICTED,
    FAILED,
    READY,
    REPORTED,
    STATES,
    WORKER_START,
    WORKER_TRANSITIONS,
    ContextStatus,
)

logger = logging.getLogger(__name__)

UNKNOWN = "unknown"  # a context nobody registered
WAIT = "wait"  # loading somewhere, or no report yet, or no workers
_HISTORY = 16
# The identity and state of a report are handled apart from its other fields.
_COUNTERS = tuple(c for c in REPORTED if c not in ("worker", "context", "state", "level"))


def _reachable(table: Mapping[str, frozenset[str]], start: Iterable[str]) -> frozenset[str]:
    seen: set[str] = set()
    todo = list(start)
    while todo:
        state = todo.pop()
        if state not in seen:
            seen.add(state)
            todo.extend(table.get(state, ()))
    return frozenset(seen)


def scheduler_transitions() -> dict[str, frozenset[str]]:
    """The scheduler's transitions, derived from the worker's
    (:data:`~dask_pcm.protocol.WORKER_TRANSITIONS`).

    A worker coalesces the changes it makes between two reports, so the scheduler may see
    any state reachable from the one it knows (``fetching`` -> ``ready``). It starts each
    placement at ``absent``, from where any state a worker plugin can reach is allowed, and
    so it is from ``closed``: a worker plugin set up again on that worker. Nothing goes back
    to ``absent``, and ``failed`` only to ``closed``.
    """
    fresh = _reachable(WORKER_TRANSITIONS, WORKER_START)
    table = {
        state: _reachable(WORKER_TRANSITIONS, WORKER_TRANSITIONS[state]) - {state}
        for state in WORKER_TRANSITIONS
    }
    table[ABSENT] = fresh
    table[CLOSED] = fresh - {CLOSED}
    return table


#: What a placement may change to from each state (:func:`scheduler_transitions`).
TRANSITIONS: dict[str, frozenset[str]] = scheduler_transitions()


@dataclass
class Placement(ContextStatus):
    """One context on one worker as the scheduler knows it: the status record, when it
    entered its state, its recent states, and the sequence number of the last report."""

    since: float = field(default_factory=time.time)
    history: list[tuple[str, float]] = field(default_factory=list)
    seq: int = -1

    def __post_init__(self) -> None:
        self.history.append((self.state, self.since))

    def move(self, state: str, now: float) -> bool:
        """Enter ``state`` at time ``now``; whether the state changed (staying is no change).

        Raises
        ------
        TransitionError
            :data:`TRANSITIONS` does not allow it; names the context, worker and states.
        """
        if state == self.state:
            return False
        allowed = TRANSITIONS.get(self.state, frozenset())
        if state not in allowed:
            what = f"unknown state {state!r}" if state not in STATES else f"to {state}"
            raise TransitionError(
                f"context {self.context!r} on worker {self.worker} cannot go from "
                f"{self.state} {what} on the scheduler (from {self.state}: "
                f"{', '.join(sorted(allowed)) or 'nowhere'})"
            )
        self.state = state
        self.since = now
        self.history.append((state, now))
        del self.history[:-_HISTORY]
        return True

    def status_row(self, now: float) -> dict[str, Any]:
        """The status row, with the time spent in the current state."""
        return {**self.row(), "state_seconds": round(now - self.since, 3)}


class ContextStates:
    """Per context and worker, a :class:`Placement`; the levels contexts are declared at."""

    def __init__(self) -> None:
        self.levels: dict[str, str] = {}
        self.placements: dict[str, dict[str, Placement]] = {}
        # Load durations observed (for the Prometheus histogram), per context.
        self.load_durations: dict[str, list[float]] = {}

    # -- changes -------------------------------------------------------------------------
    def declare(self, name: str, level: str, workers: Iterable[str], fresh: bool = False) -> None:
        """A context was registered: expect a report from every worker (``fresh``: from a
        new worker plugin, so what the workers reported before is dropped)."""
        self.levels[name] = level
        by_worker = self.placements.setdefault(name, {})
        for worker in workers:
            current = by_worker.get(worker)
            if fresh or current is None or current.level != level:
                by_worker[worker] = Placement(worker=worker, context=name, level=level)

    def forget(self, name: str) -> None:
        self.levels.pop(name, None)
        self.placements.pop(name, None)
        self.load_durations.pop(name, None)

    def add_worker(self, worker: str) -> None:
        for name, level in self.levels.items():
            self.placements[name].setdefault(
                worker, Placement(worker=worker, context=name, level=level)
            )

    def remove_worker(self, worker: str) -> list[str]:
        """Forget ``worker``; the contexts it had."""
        return [name for name, by in self.placements.items() if by.pop(worker, None)]

    def report(self, worker: str, context: str, state: str, seq: int, info: dict[str, Any]) -> bool:
        """Apply a worker's report; whether the context's state changed there.

        A report asking for a transition :data:`TRANSITIONS` refuses is dropped whole, with
        an error in the scheduler's log: raising here would close the worker's stream.
        """
        by_worker = self.placements.get(context)
        if by_worker is None:
            return False  # unregistered meanwhile
        placement = by_worker.get(worker)
        if placement is None:
            placement = by_worker[worker] = Placement(
                worker=worker, context=context, level=info.get("level", "")
            )
        if seq <= placement.seq:
            return False  # an older report, overtaken
        try:
            changed = placement.move(state, time.time())
        except TransitionError as exc:
            logger.error("Report dropped: %s", exc)
            return False
        placement.seq = seq
        loads_before = placement.loads
        for attr in _COUNTERS:
            if attr in info:
                setattr(placement, attr, info[attr])
        if placement.loads > loads_before and placement.level == "full":
            self.load_durations.setdefault(context, []).append(placement.last_load_seconds)
        return changed

    def task_done(self, names: Iterable[str], worker: str, ok: bool) -> None:
        """A context task finished on ``worker`` (``ok``) or raised there."""
        for name in names:
            placement = self.placements.get(name, {}).get(worker)
            if placement is None:
                continue
            if ok:
                placement.tasks += 1
            else:
                placement.task_errors += 1

    # -- questions -------------------------------------------------------------------------
    def eligible(self, name: str) -> tuple[set[str], str]:
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
        return set(), WAIT

    def all_ready(self, names: Iterable[str], workers: Iterable[str]) -> bool:
        """Whether every one of ``workers`` (the connected ones) has all of ``names`` ready."""
        workers = set(workers)
        for name in names:
            by_worker = self.placements.get(name)
            if not by_worker or len(by_worker) < len(workers):
                return False
            if any(p.state != READY for p in by_worker.values()):
                return False
        return bool(workers)

    def ready_on(self, name: str) -> set[str]:
        return {w for w, p in self.placements.get(name, {}).items() if p.state == READY}

    def holders(self, digest: str) -> set[str]:
        """Workers that report a complete copy of the template ``digest``."""
        return {
            w
            for by_worker in self.placements.values()
            for w, p in by_worker.items()
            if p.template_held and p.template_digest == digest
        }

    def failures(self, name: str) -> dict[str, str]:
        return {w: p.error or "" for w, p in self.placements.get(name, {}).items()}

    # -- reading -----------------------------------------------------------------------------
    def rows(self, contexts: Iterable[str] | None = None) -> list[dict[str, Any]]:
        """Status rows, sorted by context then worker."""
        wanted = None if contexts is None else set(contexts)
        now = time.time()
        return [
            p.status_row(now)
            for name in sorted(self.placements)
            if wanted is None or name in wanted
            for _, p in sorted(self.placements[name].items())
        ]

    def summary(
        self, waiting: dict[str, int], pending: dict[str, int]
    ) -> dict[str, dict[str, Any]]:
        """Per context: level, workers per state, tasks served, ``pending`` tasks (queued or
        running) and, of those, ``waiting`` ones (no worker where the context is ready)."""
        out = {}
        for name, by_worker in sorted(self.placements.items()):
            states: dict[str, int] = {}
            for p in by_worker.values():
                states[p.state] = states.get(p.state, 0) + 1
            out[name] = {
                "level": self.levels.get(name),
                "workers": states,
                "tasks": sum(p.tasks for p in by_worker.values()),
                "pending_tasks": pending.get(name, 0),
                "waiting_tasks": waiting.get(name, 0),
            }
        return out


__all__ = ["ABSENT", "TRANSITIONS", "UNKNOWN", "WAIT", "ContextStates", "Placement"]
