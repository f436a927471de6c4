"""One context's state machine on one worker, and the one writer of its status record.

:class:`Lifecycle` holds the context's :class:`~dask_pcm.protocol.ContextStatus` on this
worker. Every change to it goes through here: the state through :meth:`Lifecycle.move`,
the one transition function, which refuses a change the level's table
(:meth:`dask_pcm.worker.levels.Level.transitions`) does not allow; the other fields
(copies, builds, sizes) through :meth:`Lifecycle.update` and :meth:`Lifecycle.add`. Each
change is handed to the reporter, which sends the record to the scheduler. The plugin, the
template copy and the built context's holder write nothing themselves; the memory budget
and tasks only read.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Collection
from typing import Any

from dask_pcm.exceptions import TransitionError
from dask_pcm.protocol import CLOSED, EVICTED, FAILED, READY, STATES, WORKER_START, ContextStatus
from dask_pcm.worker.levels import Level

# Set at creation and never changed; the state only by move().
_FIXED = ("worker", "context", "level", "state")


class Lifecycle:
    """The state and status record of context ``context`` on ``worker`` at ``level``.

    Parameters
    ----------
    worker, context
        The worker's address and the context's name (for the record and for messages).
    level
        The context's level: its transitions are the ones allowed.
    start
        The first state (:data:`~dask_pcm.protocol.WORKER_START`).
    changed
        Called, outside the lock, after every change (the reporter's hook); may be set
        later through :attr:`changed`.
    **fields
        Other initial fields of the record (``template``, ``location``).

    Examples
    --------
    >>> from dask_pcm.worker.levels import LEVELS
    >>> life = Lifecycle("tcp://10.0.0.5:4001", "smollm2", LEVELS["full"], "loading")
    >>> life.move("ready")
    True
    >>> life.move("fetching")
    Traceback (most recent call last):
    ...
    dask_pcm.exceptions.TransitionError: context 'smollm2' on worker tcp://10.0.0.5:4001 cannot go from ready to fetching at level full (from ready: closed, evicted)
    """

    def __init__(
        self,
        worker: str,
        context: str,
        level: Level,
        start: str,
        changed: Callable[[], None] = lambda: None,
        **fields: Any,
    ) -> None:
        self.level = level
        self._transitions = level.transitions()
        if start not in WORKER_START:
            raise TransitionError(
                f"context {context!r} on worker {worker} cannot start in state {start!r}"
            )
        self._lock = threading.Lock()  # guards the record; nothing is called while held
        self._record = ContextStatus(
            worker=worker, context=context, state=start, level=level.name, **fields
        )
        self.changed = changed

    # -- reading ---------------------------------------------------------------------------
    @property
    def state(self) -> str:
        return self._record.state

    @property
    def closed(self) -> bool:
        return self._record.state == CLOSED

    def get(self, name: str) -> Any:
        """The value of field ``name`` of the record."""
        with self._lock:
            return getattr(self._record, name)

    def record(self) -> ContextStatus:
        """A copy of the record, as it is now."""
        with self._lock:
            return dataclasses.replace(self._record)

    def report(self) -> dict[str, Any]:
        """What the worker reports of the record (:meth:`ContextStatus.report`)."""
        with self._lock:
            return self._record.report()

    # -- the one transition function ---------------------------------------------------------
    def move(
        self, to: str, error: str | None = None, only_from: Collection[str] | None = None
    ) -> bool:
        """Change the state to ``to`` (with ``error`` for ``failed``); whether it changed.

        Returns ``False`` without changing anything when the context is ``closed`` (a load
        thread that lost the race with ``teardown``: closed is final and wins) or when
        ``only_from`` is given and the state is not one of them (a conditional move, decided
        under the lock).

        Raises
        ------
        TransitionError
            ``to`` is not a state, or the level does not allow going from the current
            state to it; the message names the context, the worker and both states.
        """
        if to not in STATES:
            raise TransitionError(
                f"context {self._record.context!r} on worker {self._record.worker}: "
                f"unknown state {to!r} (states: {', '.join(STATES)})"
            )
        with self._lock:
            now = self._record.state
            if now == CLOSED or (only_from is not None and now not in only_from):
                return False
            allowed = self._transitions.get(now, frozenset())
            if to not in allowed:
                raise TransitionError(
                    f"context {self._record.context!r} on worker {self._record.worker} "
                    f"cannot go from {now} to {to} at level {self.level.name} "
                    f"(from {now}: {', '.join(sorted(allowed)) or 'nowhere'})"
                )
            self._record.state = to
            if to == FAILED:
                self._record.error = error
            elif to == READY:
                self._record.error = None  # a rebuild that worked clears an old failure
            elif to == EVICTED:
                self._record.evictions += 1
        self.changed()
        return True

    # -- the other fields ------------------------------------------------------------------
    def update(self, **values: Any) -> bool:
        """Set fields of the record (not its identity nor its state); whether any changed."""
        self._check(values)
        with self._lock:
            changed = any(getattr(self._record, k) != v for k, v in values.items())
            for name, value in values.items():
                setattr(self._record, name, value)
        if changed:
            self.changed()
        return changed

    def add(self, **amounts: float) -> None:
        """Add to counters of the record (bytes copied, builds, seconds)."""
        self._check(amounts)
        with self._lock:
            for name, amount in amounts.items():
                setattr(self._record, name, getattr(self._record, name) + amount)
        self.changed()

    def _check(self, values: dict[str, Any]) -> None:
        bad = [k for k in values if k in _FIXED or not hasattr(self._record, k)]
        if bad:
            raise TransitionError(
                f"context {self._record.context!r} on worker {self._record.worker}: "
                f"{', '.join(bad)} cannot be set here (the state changes through move())"
            )
