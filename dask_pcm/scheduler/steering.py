"""Context tasks sent only where their contexts are ready: restriction sets, not resources.

Tasks whose function is a :class:`~dask_pcm.tasks.ContextTask` get worker restrictions in
``update_graph``, before the scheduler places them. All tasks that need the same set of
contexts share *one* restriction set object, updated in place when a worker's state changes:
one set operation per state change, however many tasks wait. Worker resources were the
alternative; they were not chosen because a resource also caps how many tasks run at once, a
task that requires a resource no worker has can never fall back (``allow_other_workers`` only
loosens worker and host restrictions), and a worker that lost a resource (eviction) would
keep tasks it can no longer run. Work stealing honours worker restrictions
(``WorkStealing._get_thief``), so a stolen task only moves to another worker in the set. A
task submitted with explicit ``workers=`` keeps them.

In the steady state, when every connected worker has the task's contexts ready, no
restriction is needed and none is set: Dask places (and queues) those tasks exactly like plain
ones, at no extra cost. The moment a worker is not ready (one joins, fails, is evicted), every
such task that has not run yet gets the shared set, before the scheduler can offer the
newcomer any work; tasks waiting in Dask's queue, which ignores restrictions, are taken out
and placed again.

The set holds the workers where every needed context is ``ready``; when there are none, those
where it was ``evicted`` (they rebuild it on demand); else nobody, and the tasks wait in
``no-worker`` until a worker becomes ready. When every connected worker has *failed* to build
a context, its waiting tasks err at once with the loaders' messages
(:class:`~dask_pcm.ContextLoadError`) instead of waiting forever; when every worker that has
it has been loading for longer than ``pcm.worker.ready-timeout``, they err with
:class:`~dask_pcm.ContextTimeoutError`. Tasks with ``allow_other_workers=True`` have loose
restrictions: with no worker in the set, the scheduler may place them anywhere, and that
worker waits for (or rebuilds) the context.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from distributed.protocol.pickle import dumps

from dask_pcm import config
from dask_pcm.exceptions import ContextLoadError, ContextNotFoundError, ContextTimeoutError
from dask_pcm.protocol import ABSENT, FAILED, FETCHING, LOADING
from dask_pcm.scheduler.state import UNKNOWN, ContextStates
from dask_pcm.tasks import ContextTask

if TYPE_CHECKING:
    from distributed import Scheduler

logger = logging.getLogger(__name__)

_HOPELESS = (FAILED, UNKNOWN)
# A restriction set is never empty (empty means "unrestricted" to the scheduler): this
# address, which no worker has, keeps it restricting when no worker qualifies.
NOBODY = "dask-pcm://no-worker-with-context"


class Steering:
    """The restriction sets of context tasks, kept in step with :class:`ContextStates`."""

    def __init__(self, scheduler: Scheduler, states: ContextStates) -> None:
        self.scheduler = scheduler
        self.states = states
        # Shared restriction set per combination of contexts a task needs.
        self._allowed: dict[tuple[str, ...], set[str]] = {}
        # The contexts each live context task needs.
        self.needs: dict[Any, tuple[str, ...]] = {}
        # Context tasks left unrestricted because every worker was ready when they came.
        self._free: dict[Any, tuple[str, ...]] = {}

    # -- new tasks, finished tasks ---------------------------------------------------------
    def new_tasks(self, keys: Iterable[Any]) -> None:
        """Restrict the context tasks among ``keys`` (from ``update_graph``)."""
        seen: set[tuple[str, ...]] = set()
        all_ready: dict[tuple[str, ...], bool] = {}  # once per combination, not per task
        for key in keys:
            ts = self.scheduler.tasks.get(key)
            func = getattr(getattr(ts, "run_spec", None), "func", None)
            if ts is None or not isinstance(func, ContextTask):
                continue
            names = func.names
            self.needs[key] = names
            seen.add(names)
            if ts.worker_restrictions or ts.host_restrictions:
                continue  # the user chose workers explicitly
            if names not in all_ready:
                all_ready[names] = self.states.all_ready(names, self.scheduler.workers)
            if all_ready[names]:
                self._free[key] = names
                continue
            ts.worker_restrictions = self._allowed_for(names)
            ts.loose_restrictions = func.allow_other_workers
        hopeless = {n for names in seen for n in names if self.states.eligible(n)[1] in _HOPELESS}
        if hopeless:
            # The new tasks reach "no-worker" only after update_graph returns.
            asyncio.get_running_loop().call_soon(
                self.fail_waiting, hopeless, f"pcm-context-failed-{time.time()}"
            )

    def forget_task(self, key: Any) -> None:
        self.needs.pop(key, None)
        self._free.pop(key, None)

    def waiting(self) -> dict[str, int]:
        """Per context, tasks waiting for a worker where it is ready."""
        out: dict[str, int] = {}
        for ts in self.scheduler.unrunnable:
            for name in self.needs.get(ts.key, ()):
                out[name] = out.get(name, 0) + 1
        return out

    def pending(self) -> dict[str, int]:
        """Per context, its unfinished tasks: queued, waiting for a worker, or running."""
        out: dict[str, int] = {}
        for key, names in self.needs.items():
            ts = self.scheduler.tasks.get(key)
            if ts is not None and ts.state not in _FINISHED:
                for name in names:
                    out[name] = out.get(name, 0) + 1
        return out

    def wanted(self) -> set[str]:
        """Contexts that unfinished context tasks need."""
        return set(self.pending())

    # -- state changes -----------------------------------------------------------------------
    def refresh(self, names: Iterable[str], stimulus_id: str) -> None:
        """Recompute the restriction sets that involve ``names``; wake or fail waiters."""
        names = set(names)
        if self._free:
            workers = self.scheduler.workers
            not_ready = {n for n in names if not self.states.all_ready((n,), workers)}
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
                needs = self.needs.get(ts.key)
                if needs and names.intersection(needs) and self.scheduler.valid_workers(ts):
                    recs[ts.key] = "processing"
            if recs:
                self.scheduler.transitions(recs, stimulus_id)
        hopeless = {n for n in names if self.states.eligible(n)[1] in _HOPELESS}
        if hopeless:
            self.fail_waiting(hopeless, stimulus_id)

    def _restrict_free(self, names: set[str], stimulus_id: str) -> None:
        """Give the free tasks needing any of ``names`` their restriction sets.

        Queued tasks leave Dask's queue (which ignores restrictions) and are placed again.
        """
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
            allowed = self._allowed[names] = {NOBODY}
            self._update_allowed(names, allowed)
        return allowed

    def _update_allowed(self, names: tuple[str, ...], allowed: set[str]) -> None:
        workers: set[str] | None = None
        for name in names:
            eligible = self.states.eligible(name)[0]
            workers = eligible if workers is None else workers & eligible
        allowed.clear()
        allowed.add(NOBODY)
        allowed.update(workers or ())

    # -- failing waiters -------------------------------------------------------------------
    def fail_waiting(self, names: set[str], stimulus_id: str) -> None:
        """Err the waiting tasks of contexts that failed on every worker or are unknown."""
        for name in names:
            reason = self.states.eligible(name)[1]
            if reason == UNKNOWN:
                known = sorted(self.states.levels) or "none"
                exc: Exception = ContextNotFoundError(
                    f"context {name!r} is not registered (registered: {known}); "
                    "call dask_pcm.register(client, context) first"
                )
            elif reason == FAILED:
                failures = self.states.failures(name)
                lines = [f"context {name!r} failed on every worker ({len(failures)}):"]
                lines += [f"  {w}: {msg}" for w, msg in sorted(failures.items())]
                exc = ContextLoadError("\n".join(lines), failures)
            else:
                continue
            self._err_unrunnable(_needing(name), exc, stimulus_id)

    def fail_stuck(self) -> None:
        """Err tasks waiting for a context that no worker finished loading in time.

        Applies ``pcm.worker.ready-timeout`` on the scheduler: when every worker that has
        the context has been absent, fetching or loading for longer than that, its waiting
        tasks err with :class:`~dask_pcm.ContextTimeoutError`. With no workers at all (jobs
        still queued on a batch system) tasks keep waiting.
        """
        timeout = config.ready_timeout()
        if timeout is None or not self.scheduler.unrunnable:
            return
        now = time.time()
        for name, by_worker in list(self.states.placements.items()):
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
            self._err_unrunnable(_needing(name), exc, f"pcm-stuck-{now}")

    def _err_unrunnable(
        self, needs: Callable[[tuple[str, ...]], bool], exc: BaseException, stimulus_id: str
    ) -> None:
        doomed = [
            ts.key
            for ts in self.scheduler.unrunnable
            if ts.key in self.needs and needs(self.needs[ts.key]) and not ts.loose_restrictions
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


_FINISHED = ("memory", "erred", "forgotten")


def _needing(name: str) -> Callable[[tuple[str, ...]], bool]:
    """Whether a task needing the contexts ``combo`` needs ``name``."""
    return lambda combo: name in combo
