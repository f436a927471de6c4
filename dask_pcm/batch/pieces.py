"""Pieces of units, and what the dispatch does when a worker dies running some.

A task runs whole units; after a worker died running it, its units run apart, a unit in up
to :data:`SPLIT` pieces, and so on down to single rows (:func:`after_loss`). A worker that
dies takes every task queued on it along, so a loss names no culprit until one row runs
alone: a lost single row goes into quarantine, where it runs with nothing else of the run in
flight, and one lost :data:`ROW_LOSSES` times there is blamed (recorded as an error row).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from dask_pcm import protocol
from dask_pcm.batch.failures import last_worker
from dask_pcm.batch.units import Unit, WaveRows

logger = logging.getLogger(__name__)

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
