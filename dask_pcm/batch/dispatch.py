"""Sending a batch run's units to the cluster, and their rows to the output as they return.

Three things keep a run of 90,910 units cheap on the client, the scheduler and per unit:

- **Packed tasks.** One task runs several consecutive units of one group
  (:func:`~dask_pcm.batch.units.run_units`), as many as take about ``pcm.batch.task-seconds``
  by the scoring time the tasks report (one unit per task until the first returns, 64 at
  most: :mod:`dask_pcm.batch.sizing`). With a small model, a unit of 32 claims takes
  milliseconds, about what Dask spends on a task (messages, transitions, the result's trip back); packing keeps that cost a small
  part of the work on fast GPUs and slow CPUs alike. Units stay the grain of the output and
  of a resume. Near the end, tasks shrink so that every worker thread gets a share.
- **Waves.** At most ``pcm.batch.tasks-in-flight`` tasks (default 4 per worker thread, at
  least 64) are submitted and not yet returned; the rest of the units wait on the client as
  plain objects. The scheduler never holds the whole grid, and a finished task's result is
  written and released before the next is sent.
- **Rows by reference.** The rows of a wave's tasks (and their groups' parameters) go to a
  worker once, scattered as one key (:class:`~dask_pcm.batch.units.WaveRows`); each task
  carries the key and index ranges. Task messages, and the copies of recent messages that
  distributed keeps on every stream (``distributed.admin.low-level-log-length``, 1,000 per
  stream), then hold numbers, not row text: when they held the text, at the paper's scale,
  they kept the claims of a thousand packed tasks, and the client's memory grew with them.
  A task whose wave's rows were lost with a worker (it did not run there) runs again as it
  was; with no worker to scatter to, the rows travel inside the tasks.
- **Batched results.** Finished tasks are gathered together, in one request per batch, and
  their rows come back as Arrow tables; through the scheduler unless the client was made
  with ``direct_to_workers=True``. On a local cluster (the scheduler in the client's
  process) fetching from the workers directly cost the client more CPU per unit, not less,
  and sending rows by reference less than sending them inline.

Tasks run in submission order (each wave has a lower priority than the last).

What a long run survives:

- **A row that kills its worker** (a crash, the memory killer) costs that row, not the run
  and not its neighbours. Tasks ask the scheduler to give up on them at the first worker that
  dies running them (:data:`~dask_pcm.protocol.LOSSES_ANNOTATION`); the dispatch then runs
  the lost task's units apart, a lost unit in up to four pieces, and so on down to single
  rows. A worker that dies takes every task queued on it along, so a loss names no culprit
  until one row runs alone: a lost single row goes into *quarantine*, where it runs with
  nothing else of the run in flight (the others drain first). A row lost twice in
  quarantine becomes an error row (``error_rows(unit, message)``), and the run goes on.
  Preempted workers cost a few smaller tasks and a short drain, never a row.
- **Time without results.** Every ``TICK`` seconds, whether or not a task returned, the
  dispatch calls ``on_tick`` (the output store writes its open segment when due) and, where
  the cluster has one, its ``raise_if_stuck()`` (a batch cluster whose jobs are rejected
  fails the run with the batch system's message instead of waiting forever).
- **A unit whose function raises** is reported (``on_error``); the other units of its task
  are kept.
- **A task past its timeout** (``timeout``, ``pcm.batch.task-timeout``; measured from when it
  started running, as the workers' heartbeats report) has its units reported as timed out,
  and its worker is restarted through its nanny: a thread cannot be stopped, and a stuck one
  would hold the worker's contexts. Without a nanny the worker is left as it is, with a
  warning. The other tasks lost with the restart run again; none is blamed.
- **A worker lost while a wave's rows are scattered to it** costs another try of the
  scatter, on the workers that remain (a closed call is not a lost scheduler: the
  dispatch asks the scheduler again before it gives up).
- **A lost scheduler** ends the run with :class:`~dask_pcm.exceptions.ClusterLostError`
  naming the scheduler's address.
"""
# one room: the dispatch loop and what it does when a task is lost, stuck or failing (the
# pieces a lost task is split into, the quarantine, timeouts) read as one story; apart, the
# loss handling needed a Protocol to refer back to the loop's tasks.

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import CancelledError
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import dask
from distributed import Client, Future, as_completed
from distributed.comm.core import CommClosedError
from distributed.scheduler import KilledWorker

from dask_pcm import client as pcm
from dask_pcm import protocol
from dask_pcm.batch.sizing import MAX_UNITS_PER_TASK, MIN_IN_FLIGHT, Sizing
from dask_pcm.batch.units import (
    OutputColumns,
    Unit,
    WaveRows,
    Work,
    error_rows,
    run_units,
    unit_tables,
)
from dask_pcm.batch.watch import (
    TICK,
    check_cluster,
    next_batch,
    scheduler_answers,
    scheduler_lost,
)
from dask_pcm.exceptions import UnitError

if TYPE_CHECKING:
    import pyarrow as pa

logger = logging.getLogger(__name__)


# Pieces of units: what a task runs, and what the dispatch does when a worker dies running
# some. A task runs whole units; after a worker died running it, its units run apart, a
# unit in up to SPLIT pieces, and so on down to single rows (after_loss). A lost single row
# goes into quarantine, where it runs with nothing else of the run in flight, and one lost
# ROW_LOSSES times there is blamed (recorded as an error row).

#: Pieces a lost piece of several rows is split into.
SPLIT = 4
#: Times a single row may be lost with its worker, alone, before it is blamed.
ROW_LOSSES = 2


@dataclass(frozen=True)
class Piece:
    """Rows ``start ..`` of a unit: the whole unit, or a part of one that was lost."""

    unit: Unit
    start: int = 0
    losses: int = 0  # times lost with its worker as a single row in quarantine

    @property
    def rows(self) -> int:
        return len(self.unit.rows)


@dataclass
class Task:
    pieces: list[Piece]
    alone: bool = False  # run from quarantine, with nothing else of the run in flight
    timed_out: str | None = None  # why it was given up, once past its timeout
    rows: Any = None  # its wave's rows: the Future of a WaveRows, or one sent inline


def pack_wave(tasks: list[Task]) -> tuple[WaveRows, list[list[tuple[str, int, int]]]]:
    """The rows of every piece of ``tasks`` (and their groups' parameters) as one
    :class:`WaveRows`, and per task its pieces as (unit name, start, stop) in it."""
    rows: list[Any] = []
    params: dict[str | None, Any] = {}
    ranges = []
    for task in tasks:
        spans = []
        for piece in task.pieces:
            unit = piece.unit
            spans.append((unit.name, len(rows), len(rows) + len(unit.rows)))
            rows.extend(unit.rows)
            params.setdefault(unit.group, unit.params)
        ranges.append(spans)
    return WaveRows(tuple(rows), params), ranges


@dataclass
class Loss:
    """What to do after a task was lost with its worker: pieces to run again each as a task
    of its own, single rows to run in quarantine, and the row blamed (with why), if any."""

    retry: list[Piece] = field(default_factory=list)
    quarantine: list[Piece] = field(default_factory=list)
    blamed: Piece | None = None
    message: str = ""


def after_loss(task: Task, error: BaseException) -> Loss:
    """What to do with ``task``, lost with its worker (``error``: the ``KilledWorker``)."""
    pieces = task.pieces
    if len(pieces) > 1:
        logger.warning(
            "Worker %s died running units %s..%s; running each of them alone",
            last_worker(error),
            pieces[0].unit.name,
            pieces[-1].unit.name,
        )
        return Loss(retry=list(pieces))
    piece = pieces[0]
    if piece.rows > 1:
        size = -(-piece.rows // SPLIT)
        rows = piece.unit.rows
        logger.warning(
            "Worker %s died running %d rows of unit %s; running them in %d pieces",
            last_worker(error),
            piece.rows,
            piece.unit.name,
            -(-piece.rows // size),
        )
        return Loss(
            retry=[
                Piece(dataclasses.replace(piece.unit, rows=rows[i : i + size]), piece.start + i)
                for i in range(0, piece.rows, size)
            ]
        )
    if not task.alone:
        return Loss(quarantine=[piece])  # lost along with others: no culprit yet
    if piece.losses + 1 < ROW_LOSSES:
        return Loss(quarantine=[dataclasses.replace(piece, losses=piece.losses + 1)])
    message = (
        f"its worker died each of the {piece.losses + 1} times this row was run "
        f"alone (last: {last_worker(error)})"
    )
    logger.error("Unit %s row %d: %s", piece.unit.name, piece.start, message)
    return Loss(blamed=piece, message=message)


def task_key(task: Task) -> str:
    """A fresh key for ``task``, naming its first unit (and row, for a piece)."""
    first = task.pieces[0]
    part = f"-r{first.start}" if first.start or first.losses else ""
    name = f"{first.unit.name}{part}-x{len(task.pieces)}-{os.urandom(4).hex()}"
    return f"{protocol.SPLITTABLE_PREFIX}{name}"


# Tasks past their timeout, and a unit's failure when the run stops at the first.


def overdue(
    client: Client, running: Mapping[Future, Task], timeout: float
) -> Iterator[tuple[Task, str]]:
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


__all__ = ["MAX_UNITS_PER_TASK", "MIN_IN_FLIGHT", "Dispatch"]

#: Scatters of one wave's rows that may fail with the scheduler alive (workers lost during
#: them) before the rows travel inside the tasks instead.
SCATTER_TRIES = 3


class Dispatch:
    """Run ``todo`` on ``client``; ``on_unit(name, table)`` receives each finished unit.

    Parameters
    ----------
    client
        A client whose cluster has ``work.contexts`` registered (and dask_pcm's scheduler
        plugin, which a run without contexts installs with
        :func:`dask_pcm.client.install_scheduler_plugin`).
    todo
        The units, in the order they should run (consecutive units of one group are packed
        together).
    work
        The function, its arguments, contexts, output layout and timeout.
    on_unit
        Called with each finished unit's name and rows.
    on_error
        Called with the name and a record (``type``, ``message``, ``traceback``, ``worker``,
        ``attempt``) of each unit whose function raised or that timed out; it may raise to
        stop the run. Default: raise :class:`UnitError`.
    progress
        Called with the number of units just finished (failed ones included).
    in_flight
        Tasks in flight at most; default ``pcm.batch.tasks-in-flight``.
    on_tick
        Called about every second from the loop, whether or not a task returned (the
        output store's ``flush_if_due``).
    columns
        The output's column types so far (an output folder's, on a resume): a unit whose
        rows do not fit them is that unit's error.
    deadline
        A ``time.monotonic()`` past which nothing more is submitted and the tasks in flight
        are cancelled: the loop returns with ``expired`` set and the units not finished by
        then left out (neither handed over nor failed).
    """

    def __init__(
        self,
        client: Client,
        todo: list[Unit],
        work: Work,
        on_unit: Callable[[str, pa.Table], None],
        on_error: Callable[[str, dict[str, Any]], None] | None = None,
        progress: Callable[[int], None] = lambda n: None,
        in_flight: int | None = None,
        on_tick: Callable[[], Any] = lambda: None,
        columns: OutputColumns | None = None,
        deadline: float | None = None,
    ) -> None:
        self.client = client
        self.deadline = deadline
        self.expired = False
        self.queue: deque[Unit] = deque(todo)
        self.work = work
        self.on_unit = on_unit
        self.on_error = on_error or raise_unit_error
        self.progress = progress
        self.on_tick = on_tick
        self.sizing = Sizing(client, in_flight)
        self.tasks = 0  # submitted, resubmissions included
        self.lost_rows = 0  # rows recorded as errors because they killed their workers
        self.failed_units = 0  # units whose function raised, or that timed out
        self.served: dict[str, int] = {}  # tasks whose results came back, per worker
        self._waves = 0
        self._running: dict[Future, Task] = {}
        self._retry: deque[Piece] = deque()  # pieces of lost tasks, each a task of its own
        self._again: deque[Task] = deque()  # tasks whose wave's rows were lost: run again
        self._quarantine: deque[Piece] = deque()  # lost single rows, run one at a time
        self._parts: dict[str, list[tuple[int, pa.Table]]] = {}
        self.columns = columns or OutputColumns()  # the output's column types so far
        self._totals = {u.name: len(u.rows) for u in todo}  # rows of each unit
        self._attempts: dict[str, int] = {}
        self._ticked = time.monotonic()

    # -- submitting -------------------------------------------------------------------------
    def _next_tasks(self) -> list[Task]:
        if self._quarantine:
            # Nothing else in flight, so that a worker that dies now died of this row.
            if self._running:
                return []
            return [Task([self._quarantine.popleft()], alone=True)]
        tasks: list[Task] = []
        in_flight = self.sizing.in_flight()
        while self._again and len(self._running) + len(tasks) < in_flight:
            tasks.append(self._again.popleft())
        while self._retry and len(self._running) + len(tasks) < in_flight:
            tasks.append(Task([self._retry.popleft()]))
        while self.queue and len(self._running) + len(tasks) < in_flight:
            size = self.sizing.units_per_task(len(self.queue))
            first = self.queue.popleft()
            pack = [first]
            while self.queue and len(pack) < size and self.queue[0].group == first.group:
                pack.append(self.queue.popleft())
            tasks.append(Task([Piece(u) for u in pack]))
        return tasks

    def _submit(self, tasks: list[Task]) -> list[Future]:
        if not tasks:
            return []
        self._waves += 1
        work = self.work
        for task in tasks:
            for piece in task.pieces:
                self._attempts[piece.unit.name] = self._attempts.get(piece.unit.name, 0) + 1
        wave, ranges = pack_wave(tasks)
        rows = _send(self.client, wave)
        for task in tasks:
            task.rows = rows
        # Given up at the first worker that dies running it: the loop splits it then.
        arguments = (
            [work.fn] * len(tasks),
            [rows] * len(tasks),
            ranges,
            [t.pieces[0].unit.group for t in tasks],
        )
        options: dict[str, Any] = dict(
            kwargs=dict(work.kwargs),
            layout=work.layout,
            key=[task_key(t) for t in tasks],
            priority=-self._waves,  # earlier waves first
            pure=False,
        )
        with dask.annotate(**{protocol.LOSSES_ANNOTATION: 1}):
            if work.contexts:
                context = list(work.contexts)
                futures = pcm.map(self.client, run_units, *arguments, context=context, **options)
            else:  # a function that needs no context: any worker
                futures = self.client.map(run_units, *arguments, **options)
        self.tasks += len(tasks)
        self._running.update(zip(futures, tasks, strict=True))
        return futures

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> None:
        """Submit, collect and hand over every unit; on any error the tasks still running
        are cancelled and the error raised."""
        try:
            queue = as_completed(self._submit(self._next_tasks()))
            while not queue.is_empty():
                if self.deadline is not None and time.monotonic() >= self.deadline:
                    self._expire()
                    break
                batch = next_batch(queue, TICK)
                if batch:
                    self._collect(batch, queue)
                    queue.update(self._submit(self._next_tasks()))
                if time.monotonic() - self._ticked >= TICK:
                    self._tick()
            self.on_tick()
        except BaseException as exc:
            # A call to the scheduler (a gather, a check for overdue tasks) under way when it
            # died, or when the network to it dropped, ends with its own error: a closed
            # comm, or an OSError after trying to connect for
            # ``distributed.comm.timeouts.connect``. Once the client has given up
            # reconnecting and closed, the next call fails on what closing took away (a
            # RuntimeError from its closed connection pool, an AttributeError on its
            # scheduler, now None): whatever it is, the scheduler is what was lost. (A
            # scatter whose worker died closes the comm too; _send tells that apart and
            # tries again.)
            closed = isinstance(exc, CommClosedError)
            lost = closed or (isinstance(exc, Exception) and self.client.status != "running")
            if not lost and self.client.status == "running":
                self.client.cancel(list(self._running))
            self._running.clear()
            if lost:
                why = str(exc)
                if closed and scheduler_answers(self.client):
                    why += (
                        "; the scheduler answers again: the connection dropped during a "
                        "call, and a rerun resumes"
                    )
                raise scheduler_lost(self.client, why) from exc
            raise

    def _expire(self) -> None:
        """The deadline passed: cancel what runs, forget what waits."""
        self.expired = True
        if self._running:
            self.client.cancel(list(self._running))
        for waiting in (self._running, self.queue, self._retry, self._again, self._quarantine):
            waiting.clear()
        self._parts.clear()

    @property
    def unfinished(self) -> int:
        """Units neither handed over nor failed (those left out when the deadline passed)."""
        return len(self._totals)

    def _tick(self) -> None:
        self._ticked = time.monotonic()
        self.on_tick()
        check_cluster(self.client, len(self._running))
        if self.work.timeout is not None and self._running:
            for task, why in overdue(self.client, self._running, self.work.timeout):
                task.timed_out = why

    def _collect(self, batch: list[Future], queue: as_completed) -> None:
        finished = [f for f in batch if f.status == "finished"]
        for future in batch:
            if future.status != "finished":
                self._failed(future)
        while True:
            try:
                results = self.client.gather(finished) if finished else []
                break
            except CancelledError:
                # A result that went with its worker, whose wave's rows went too: it cannot
                # be computed again from them, so it is cancelled (and run again from here).
                gone = [f for f in finished if f.status != "finished"]
                if not gone:
                    raise
                for future in gone:
                    self._failed(future)
                finished = [f for f in finished if f.status == "finished"]
        for future, result in zip(finished, results, strict=True):
            task = self._running.pop(future)
            self.sizing.learn(result["seconds"], len(task.pieces))
            worker = result.get("worker")
            if worker:
                self.served[worker] = self.served.get(worker, 0) + 1
            for piece, (name, table) in zip(task.pieces, unit_tables(result), strict=True):
                if table is None:
                    self._unit_failed(piece.unit, result["errors"][name])
                else:
                    self._piece_done(piece, table)

    def _unit_failed(self, unit: Unit, record: dict[str, Any]) -> None:
        """A unit whose function raised (or that timed out): reported, never retried here."""
        if unit.name not in self._totals:
            return  # another piece of it failed already
        del self._totals[unit.name]
        self._parts.pop(unit.name, None)
        self.failed_units += 1
        self.on_error(unit.name, {**record, "attempt": self._attempts.get(unit.name, 1)})
        self.progress(1)

    def _piece_done(self, piece: Piece, table: pa.Table) -> None:
        """Hand over a unit when its last piece is in (rows in the unit's order)."""
        name = piece.unit.name
        if name not in self._totals:
            return  # the unit failed in another piece: reported already
        parts = self._parts.setdefault(name, [])
        parts.append((piece.start, table))
        if sum(t.num_rows for _, t in parts) < self._totals[name]:
            return
        if len(parts) == 1:
            whole = parts[0][1]
        else:
            import pyarrow as pa

            parts.sort(key=lambda part: part[0])
            try:
                whole = pa.concat_tables([t for _, t in parts], promote_options="permissive")
            except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
                self._unit_failed(piece.unit, _record("TypeError", f"unit {name}: {exc}"))
                return
        problem = self.columns.admit(name, whole)
        if problem is not None:
            self._unit_failed(piece.unit, _record("TypeError", problem))
            return
        del self._parts[name]
        del self._totals[name]
        self.on_unit(name, whole)
        self.progress(1)

    def _failed(self, future: Future) -> None:
        """Split a task lost with its workers; raise anything else."""
        task = self._running.pop(future)
        if future.status == "cancelled" and _lost(task.rows):
            # A lost scheduler cancels every future, the rows' too: raise that.
            check_cluster(self.client, len(self._running) + 1)
            # Its wave's rows went with a worker that died; the task itself did not run
            # there (a task that did fails with KilledWorker first): not a loss of its own.
            self._again.append(task)
            return
        if future.status == "lost":
            # Finished, but its result went with a worker before it was gathered.
            self.client.cancel([future])
            self._retry.extend(task.pieces)
            return
        if future.status != "error":
            check_cluster(self.client, len(self._running))
            raise RuntimeError(
                f"task {future.key} ended as {future.status!r}, not finished: cancelled by "
                "another client, or its cluster closed"
            )
        error = future.exception()
        if task.timed_out is not None:
            for piece in task.pieces:
                record = {"type": "TimeoutError", "message": task.timed_out, "traceback": None}
                self._unit_failed(piece.unit, {**record, "worker": last_worker(error)})
            return
        if not isinstance(error, KilledWorker):
            raise error
        self._split(task, error)

    def _split(self, task: Task, error: KilledWorker) -> None:
        loss = after_loss(task, error)
        self._retry.extend(loss.retry)
        self._quarantine.extend(loss.quarantine)
        if loss.blamed is not None:
            self.lost_rows += 1
            table = error_rows(loss.blamed.unit, loss.message, self.work.layout)
            self._piece_done(loss.blamed, table)


def _record(kind: str, message: str) -> dict[str, Any]:
    """An error record of a unit that failed on the client, not in its function."""
    return {"type": kind, "message": message, "traceback": None, "worker": None}


def _lost(rows: Future | WaveRows | None) -> bool:
    """Whether a task's wave rows were on workers that are all gone."""
    return isinstance(rows, Future) and rows.status != "finished"


def _send(client: Client, wave: WaveRows) -> Future | WaveRows:
    """``wave`` on a worker, as one key the wave's tasks depend on; the rows themselves, to
    travel inside each task, when no worker is running now (a batch cluster's first jobs
    still queued) or the scatter failed :data:`SCATTER_TRIES` times with the scheduler alive.

    A worker that dies while the scheduler hands it the rows (preempted mid-wave) closes the
    call's comm; the scheduler registers nothing then, and the next try goes to a worker
    that remains.
    """
    for attempt in range(1, SCATTER_TRIES + 1):
        try:
            if not client.nthreads():
                # Asked first: a scatter with nobody to take it waits, then fails on the
                # scheduler, which logs it as an error with its traceback (once per wave
                # while the jobs queue).
                return wave
            return client.scatter(wave, hash=False, timeout=TICK)
        except TimeoutError:  # before OSError: it is one
            return wave
        except OSError as exc:
            if not scheduler_answers(client):
                raise scheduler_lost(client, f"scattering a wave's rows: {exc}") from exc
            logger.info(
                "Scattering a wave's rows failed (%s; try %d of %d): a worker was lost "
                "during the call, the scheduler is alive",
                exc,
                attempt,
                SCATTER_TRIES,
            )
    return wave
