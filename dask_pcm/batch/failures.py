"""What a batch run does with a unit that fails: a task past its timeout (its worker
restarted), and the error raised when the run was asked to stop at the first failure."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

from distributed import Client, Future

from dask_pcm.exceptions import UnitError

logger = logging.getLogger(__name__)


class _Pieces(Protocol):
    pieces: list[Any]
    timed_out: str | None


def overdue(
    client: Client, running: Mapping[Future, _Pieces], timeout: float
) -> Iterator[tuple[_Pieces, str]]:
    """The tasks of ``running`` past ``timeout`` seconds of running (as the workers'
    heartbeats report it) and not given up yet, each with why; their workers are restarted
    through their nannies in the background (a thread cannot be stopped, and a stuck one
    would hold its worker's contexts)."""
    keys = {f.key: f for f in running}
    restart = set()
    for key, (worker, seconds) in client.run_on_scheduler(_executing, keys=list(keys)).items():
        task = running.get(keys[key])
        if task is None or task.timed_out or seconds < timeout:
            continue
        why = f"timed out: still running after {seconds:.0f} s on {worker}"
        logger.warning(
            "Units %s..%s %s (timeout %s s); restarting that worker",
            task.pieces[0].unit.name,
            task.pieces[-1].unit.name,
            why,
            timeout,
        )
        restart.add(worker)
        yield task, why
    if restart:
        # In a thread: a restart takes seconds, and the run must go on meanwhile.
        threading.Thread(target=_restart, args=(client, sorted(restart)), daemon=True).start()


def _restart(client: Client, workers: list[str]) -> None:
    try:
        client.restart_workers(workers, raise_for_error=True)
    except Exception as exc:  # no nanny (in-process workers), or a closing cluster
        logger.warning(
            "Could not restart %s (%s): the stuck task keeps its worker thread", workers, exc
        )


def raise_unit_error(name: str, record: dict[str, Any]) -> None:
    """Raise :class:`~dask_pcm.exceptions.UnitError` for unit ``name`` (``record``: what
    went wrong)."""
    raise UnitError(
        f"unit {name} failed on {record.get('worker') or 'a worker'}: "
        f"{record['type']}: {record['message']}\n{record.get('traceback') or ''}".rstrip()
    )


def last_worker(error: BaseException | None) -> str:
    return getattr(getattr(error, "last_worker", None), "address", None) or "?"


def _executing(dask_scheduler: Any, keys: list[Any]) -> dict[Any, tuple[str, float]]:
    """On the scheduler: of ``keys``, those running on a worker, with the worker and for how
    long (the workers' heartbeats report it)."""
    wanted = set(keys)
    return {
        ts.key: (ws.address, float(seconds))
        for ws in dask_scheduler.workers.values()
        for ts, seconds in ws.executing.items()
        if ts.key in wanted
    }
