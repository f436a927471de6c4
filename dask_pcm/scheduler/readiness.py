"""The scheduler's side of :func:`dask_pcm.register`'s wait, and what was registered.

:class:`Readiness` serves the ``pcm_settle`` handler (:data:`dask_pcm.protocol.SETTLE_OP`):
it answers once every worker present when it was called has each context ``ready`` (or
``evicted``) or ``failed``, or has left, or the timeout has passed; asked for the ``first``
ready worker, as soon as each context is ready on one of them (a batch run starts its work
there while the others load). It waits on an
:class:`asyncio.Event` that the scheduler plugin's handling of the worker plugins' state
reports sets (:meth:`Readiness.changed`): no thread per worker and no polling. Contexts that
failed on every worker it waited for are unregistered before it answers.

It also keeps, per context, the token and the registration id it was last declared with
(:func:`dask_pcm.scheduler.registration.declare`): the token decides whether a new
``register`` changes anything, the registration id which reports come from the current
worker plugin (a late report of the plugin it replaced, ``ready`` of the copy being freed,
say, must not count for the new one).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from dask_pcm.protocol import ABSENT, EVICTED, FAILED, READY

if TYPE_CHECKING:
    from distributed import Scheduler

    from dask_pcm.scheduler.state import ContextStates

#: States in which a context on a worker no longer keeps ``register`` waiting.
SETTLED = (READY, EVICTED, FAILED)


class Readiness:
    """Waits for contexts to settle on workers (see the module docstring).

    Parameters
    ----------
    scheduler
        The scheduler (its ``workers`` are the connected workers).
    states
        The scheduler plugin's :class:`~dask_pcm.scheduler.state.ContextStates`.
    unregister
        Coroutine function that unregisters one context by name, from the scheduler and from
        every worker.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        states: ContextStates,
        unregister: Callable[[str], Awaitable[Any]],
    ) -> None:
        self.scheduler = scheduler
        self.states = states
        self._unregister = unregister
        self._tokens: dict[str, str] = {}
        self._registrations: dict[str, str] = {}
        self._waiters: dict[asyncio.Event, Callable[[], bool]] = {}

    # -- what was registered -------------------------------------------------------------------
    def token(self, name: str) -> str | None:
        """The token ``name`` was last declared with."""
        return self._tokens.get(name)

    def declared(self, name: str, token: str, registration: str) -> None:
        self._tokens[name] = token
        self._registrations[name] = registration

    def current(self, name: str, registration: str | None) -> bool:
        """Whether a report tagged ``registration`` comes from ``name``'s current worker
        plugin (an untagged report is taken as it comes)."""
        return registration is None or registration == self._registrations.get(name)

    def forget(self, name: str) -> None:
        self._tokens.pop(name, None)
        self._registrations.pop(name, None)
        self.changed()

    # -- the wait ----------------------------------------------------------------------------
    def changed(self) -> None:
        """A worker reported a context, a worker left or a context went: wake the waiters
        now satisfied."""
        for event, satisfied in list(self._waiters.items()):
            if satisfied():
                event.set()

    async def until(self, satisfied: Callable[[], bool], timeout: float | None = None) -> bool:
        """Wait until ``satisfied()`` holds, checked now and at every change :meth:`changed`
        hears of; whether it held within ``timeout`` seconds (``None``: no limit).

        Example
        -------
        >>> await plugin.readiness.until(lambda: "llm" in plugin.states.levels, 10)  # doctest: +SKIP
        True
        """
        if satisfied():
            return True
        event = asyncio.Event()
        self._waiters[event] = satisfied
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except TimeoutError:
            return satisfied()
        finally:
            del self._waiters[event]
        return True

    def _unsettled(self, names: list[str], workers: set[str]) -> dict[tuple[str, str], str]:
        """(context, worker) -> state, for the declared ``names`` not settled on the
        connected ones of ``workers``."""
        present = workers & set(self.scheduler.workers)
        states = {(r["context"], r["worker"]): r["state"] for r in self.states.rows(names)}
        return {
            (name, w): states.get((name, w), ABSENT)
            for name in names
            if name in self.states.levels
            for w in present
            if states.get((name, w), ABSENT) not in SETTLED
        }

    def _ready_somewhere(self, names: list[str], workers: set[str]) -> bool:
        """Whether each of ``names`` is ready on one of the connected ``workers``."""
        present = workers & set(self.scheduler.workers)
        ready = {
            r["context"]
            for r in self.states.rows(names)
            if r["worker"] in present and r["state"] in (READY, EVICTED)
        }
        return all(name in ready for name in names)

    async def settle(
        self, names: list[str], timeout: float | None = None, first: bool = False
    ) -> dict[str, Any]:
        """Scheduler handler: wait until ``names`` have settled on the workers present now,
        for at most ``timeout`` seconds (``None``: no limit); with ``first``, only until
        each is ready on one of them (those still loading are then neither waited for nor
        failures).

        Returns
        -------
        dict
            ``workers`` (those waited for that are still connected), ``left`` (those that
            left meanwhile), ``failures`` (context -> worker -> message: the loader's error,
            a context still loading at the timeout, or one unregistered meanwhile),
            ``unregistered`` (contexts that failed on every worker waited for, unregistered
            now) and ``rows`` (the contexts' status rows, as :func:`dask_pcm.status`).
        """
        workers = set(self.scheduler.workers)
        late: dict[tuple[str, str], str] = {}

        def settled() -> bool:
            if first and self._ready_somewhere(names, workers):
                return True
            return not self._unsettled(names, workers)

        if not await self.until(settled, timeout):
            late = self._unsettled(names, workers)
        present = sorted(workers & set(self.scheduler.workers))
        failures = self._failures(names, present, late, timeout)
        unregistered = [
            name
            for name, failed in failures.items()
            if len(failed) == len(present) and name in self.states.levels
        ]
        for name in unregistered:
            await self._unregister(name)
        return {
            "workers": present,
            "left": sorted(workers - set(present)),
            "failures": failures,
            "unregistered": unregistered,
            "rows": self.states.rows(names),
        }

    def _failures(
        self,
        names: list[str],
        workers: list[str],
        late: dict[tuple[str, str], str],
        timeout: float | None,
    ) -> dict[str, dict[str, str]]:
        errors = {
            (r["context"], r["worker"]): r["error"] or "the loader failed (no message)"
            for r in self.states.rows(names)
            if r["state"] == FAILED
        }
        failures: dict[str, dict[str, str]] = {}
        for name in names:
            for worker in workers:
                if name not in self.states.levels:
                    why = f"context {name!r} was unregistered while register() waited"
                elif (name, worker) in errors:
                    why = errors[name, worker]
                elif (name, worker) in late:
                    why = (
                        f"context {name!r} not ready on worker {worker} after {timeout:g} s "
                        f"(register's timeout; default pcm.worker.ready-timeout): it is still "
                        f"{late[name, worker]}"
                    )
                else:
                    continue
                failures.setdefault(name, {})[worker] = why
        return failures


__all__ = ["SETTLED", "Readiness"]
