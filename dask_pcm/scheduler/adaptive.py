"""The adaptive keep rule: which workers adaptive scaling must not retire yet.

distributed's ``Adaptive`` picks workers to retire by memory alone; retiring the last
workers where a context is ready makes the tasks waiting for it wait for a new worker's load
(or forever, with no worker left). :class:`dask_pcm.deploy.jobqueue.ContextAdaptive` asks the
scheduler plugin (``pcm_keep_workers``) which of its choices to keep; this is the answer.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from dask_pcm.scheduler.state import ContextStates


def keep_workers(
    states: ContextStates, wanted: Collection[str], leaving: Collection[str]
) -> set[str]:
    """Of the ``leaving`` workers, those to keep: for every context in ``wanted`` (that
    unfinished tasks need) whose ready workers are all leaving, one of them."""
    keep: set[str] = set()
    for name in sorted(wanted):
        ready = states.ready_on(name)
        if ready and ready <= set(leaving) and not ready & keep:
            keep.add(min(ready))
    return keep


def by_name(workers: Mapping[str, object], names: Collection[object]) -> set[str]:
    """The addresses of the workers named ``names`` (``Adaptive`` retires by name)."""
    addresses = {getattr(ws, "name", None): addr for addr, ws in workers.items()}
    return {addresses[n] for n in names if n in addresses}
