"""The output folder of a batch run: finished units appended to a few Parquet segments.

A run that is killed keeps what it finished; rerunning the same call computes only the
missing units, and no row is ever written twice. At scale (say 145,449 claims x 10 prompt
templates, 90,910 units of 16 rows) that must not mean one file per unit: a shared
filesystem's inode quota, and every resume listing them all. What this module does:

- **Only its own folders.** A folder that is not empty and holds no ``_dask_pcm_run.json``
  (say, a Spark or pandas dataset) is refused, naming what is in it; nothing in it is
  renamed, removed or added to. A folder holding only the lock and temporary files of a
  run killed before it wrote its manifest counts as its own.
- **One run at a time.** The folder is locked (``flock`` on ``.dask-pcm-run.lock``, released
  by the kernel when the run's process dies) for the whole run; a second run on the same
  folder fails at once, naming the process that holds it.
- **Provenance, not paths.** ``_dask_pcm_run.json`` records what determines the results
  (:mod:`dask_pcm.batch.provenance`: the contexts' content digests, the function and its
  arguments, the rows per unit, the input's digest, each group's parameters, and whatever
  the caller adds). A rerun compares them: the same model by another path resumes; anything
  that changed refuses, naming each difference.
- **Segments.** Finished units are appended to the open segment
  (:mod:`dask_pcm.batch.segments`); it is written out, atomically and durably, when it
  reaches ``pcm.batch.segment-rows`` rows (and a new one begins), and rewritten whole at least
  every ``pcm.batch.flush-interval`` while it fills (:meth:`OutputStore.flush_if_due`, called
  on a timer), and when the run ends or fails. A killed
  run loses at most that interval's (or segment's) finished units; the unit list goes into
  the segment's footer and then into ``_dask_pcm_index.jsonl``, which a resume reads instead
  of opening every file.
- **Atomic files.** Each write goes to a hidden temporary file of its own (process id and a
  random suffix), flushed and fsynced, then renamed into place; the folder is fsynced after
  the rename. Temporary files left by a killed run are removed when the next run takes the
  lock; a segment that cannot be read is set aside under a hidden name, with a warning, and
  its units computed again. Files of other names are never touched. A write that fails (a
  full disk) raises :class:`~dask_pcm.exceptions.OutputFolderError` naming the folder, the
  file and the error, and leaves no temporary file: the same command, run again once the
  cause is fixed, resumes from the units already written.

- **Errors apart.** Units that failed (``on_error="skip"``) are listed in
  ``_dask_pcm_errors.jsonl`` (:meth:`OutputStore.add_error`), rewritten with the segment; they
  do not count as done, so a rerun tries them again, and one that succeeds leaves the list.

``pandas.read_parquet(folder)`` reads the rows: hidden and ``_``-prefixed files are skipped by
pyarrow.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dask_pcm import config, locks
from dask_pcm.batch.files import (
    ERRORS,
    LOCK,
    MANIFEST,
    QUOTED_NAMES,
    read_errors,
    refuse_foreign,
    remove_temporary,
    write_atomically,
    write_failed,
)
from dask_pcm.batch.provenance import differences, merged
from dask_pcm.batch.segments import (
    INDEX,
    UNITS_KEY,
    Segment,
    index_text,
    is_segment,
    reconcile,
    segment_name,
    segment_number,
)
from dask_pcm.batch.segments import read_predictions as read_predictions  # where it was
from dask_pcm.exceptions import OutputFolderError

if TYPE_CHECKING:
    import pyarrow as pa

logger = logging.getLogger(__name__)

FORMAT = "dask-pcm-batch-output/2"


class OutputStore:
    """A locked output folder for one run; use it as a context manager.

    Parameters
    ----------
    root
        The folder (created with its parents if missing).
    provenance
        What determines this run's results (:mod:`dask_pcm.batch.provenance`: every key is
        compared on a resume but ``info``; ``groups`` entry by entry).
    segment_rows, flush_interval
        Default ``pcm.batch.segment-rows`` and ``pcm.batch.flush-interval``.
    accept_changes
        Provenance keys whose change a resume accepts: the folder's results are kept and
        this run's values recorded (the caller vouches that they give the same results).

    Example
    -------
    >>> with OutputStore(Path("preds.parquet"), provenance) as store:   # doctest: +SKIP
    ...     todo = [u for u in units if u.name not in store.done()]
    ...     store.add(unit.name, table)   # as each unit finishes
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        provenance: dict[str, Any],
        segment_rows: int | None = None,
        flush_interval: float | None = None,
        accept_changes: Sequence[str] = (),
    ) -> None:
        self.root = Path(root)
        self.provenance = {"format": FORMAT, **provenance}
        self.accept_changes = tuple(accept_changes)
        self.segment_rows = segment_rows or int(config.batch("segment-rows"))
        if self.segment_rows < 1:
            raise ValueError(f"pcm.batch.segment-rows must be at least 1, not {self.segment_rows}")
        interval = config.batch_seconds("flush-interval")
        self.flush_interval = (interval or 0.0) if flush_interval is None else flush_interval
        self._lock: int | None = None
        self._segments: dict[str, Segment] = {}
        self._units: set[str] = set()
        self._open = Segment(segment_name(0))
        self._tables: list[pa.Table] = []
        self._unindexed: list[str] = []
        self._flushed_at = time.monotonic()
        self._errors: dict[str, dict[str, Any]] = {}
        self._errors_changed = False

    def __enter__(self) -> OutputStore:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> None:
        """Create and lock the folder, clean up after a killed run, check provenance."""
        root = self.root
        if root.exists() and not root.is_dir():
            raise OutputFolderError(
                f"output {root} is a file; give a folder name (e.g. preds.parquet)"
            )
        # Before the lock file is created: a folder that is not ours gets nothing added.
        refuse_foreign(self.root)
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OutputFolderError(f"output folder {root} cannot be created: {exc}") from exc
        note = f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%H:%M:%S')}"
        try:
            self._lock = locks.try_lock(root / LOCK, note)
        except BlockingIOError as exc:
            raise OutputFolderError(
                f"output folder {root} is in use by another run ({exc}); wait for it to "
                "finish, or give another folder"
            ) from None
        except OSError as exc:
            raise write_failed(root, root / LOCK, exc) from exc
        try:
            remove_temporary(self.root)
            self._check_provenance()
            self._load_segments()
            self._errors = read_errors(self.root / ERRORS)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Write the open segment and release the folder."""
        if self._lock is None:
            return
        try:
            self.flush()
        finally:
            locks.unlock(self._lock)
            self._lock = None

    def _check_provenance(self) -> None:
        manifest = self.root / MANIFEST
        new = self.provenance
        if manifest.exists():
            try:
                old = json.loads(manifest.read_text())
            except (OSError, ValueError) as exc:
                raise OutputFolderError(
                    f"output folder {self.root}: {MANIFEST} cannot be read ({exc}); delete "
                    f"the folder to start over"
                ) from exc
            changed = differences(old, new, self.accept_changes)
            if changed:
                raise OutputFolderError(
                    f"output folder {self.root} holds predictions of another run: "
                    + "; ".join(changed)
                    + f". Give another folder, or delete {self.root} to start over."
                )
            new = merged(old, new)
        write_atomically(self.root, manifest, json.dumps(new, indent=1).encode())

    def done(self) -> set[str]:
        """The units already written (in earlier runs, or by this one so far)."""
        return set(self._units)

    def add(self, unit: str, table: pa.Table) -> None:
        """Append the rows of ``unit`` (a finished unit) to the open segment.

        The segment is written out when it holds ``segment_rows`` rows, and rewritten when
        ``flush_interval`` seconds have passed since it was last written. A unit already in
        the folder is refused (``ValueError``): no row is written twice.
        """
        if unit in self._units:
            raise ValueError(f"unit {unit} is already in {self.root}")
        if self._errors.pop(unit, None) is not None:
            self._errors_changed = True
        self._units.add(unit)
        self._open.units[unit] = table.num_rows
        self._tables.append(table)
        self._unindexed.append(unit)
        if self._open.rows >= self.segment_rows:
            self.flush()
            self._begin_segment()
        else:
            self.flush_if_due()

    def flush_if_due(self) -> bool:
        """Write the open segment if it holds units not yet written and ``flush_interval``
        seconds have passed since it was last written; return whether it wrote.

        Cheap when there is nothing to do (no I/O): call it from a timer, so that finished
        units reach the disk on time while no new unit arrives. Call it from the thread that
        calls :meth:`add`.

        Example
        -------
        >>> store.flush_if_due()   # doctest: +SKIP
        False
        """
        pending = self._unindexed or self._errors_changed
        if not pending or time.monotonic() - self._flushed_at < self.flush_interval:
            return False
        self.flush()
        return True

    def flush(self) -> None:
        """Write the open segment (everything added to it so far), then index it."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        self._flushed_at = time.monotonic()
        if self._errors_changed:
            lines = "".join(json.dumps(e, default=str) + "\n" for e in self._errors.values())
            write_atomically(self.root, self.root / ERRORS, lines.encode())
            self._errors_changed = False
        if not self._unindexed:
            return
        table = pa.concat_tables(self._tables, promote_options="permissive")
        metadata = {**(table.schema.metadata or {}), UNITS_KEY: json.dumps(self._open.units)}
        buffer = pa.BufferOutputStream()
        pq.write_table(table.replace_schema_metadata(metadata), buffer)
        data = buffer.getvalue().to_pybytes()
        write_atomically(self.root, self.root / self._open.name, data)
        self._open.bytes = len(data)
        self._segments[self._open.name] = self._open
        self._append_index(self._open.entry(self._unindexed))
        self._unindexed = []

    def add_error(self, unit: str, record: dict[str, Any]) -> None:
        """Record that ``unit`` failed (``record``: JSON-able, e.g. the exception, traceback,
        worker and attempt); written with the segment, replaced by a later failure of the same
        unit, dropped when it succeeds. A failed unit is not done: a rerun tries it again."""
        self._errors[unit] = {"unit": unit, **record}
        self._errors_changed = True

    def errors(self) -> dict[str, dict[str, Any]]:
        """The failed units (name -> record), of earlier runs and this one, not yet redone."""
        return dict(self._errors)

    @property
    def files(self) -> int:
        """Segment files in the folder."""
        return len(self._segments)

    def _begin_segment(self) -> None:
        number = max((segment_number(n) for n in self._segments), default=-1) + 1
        self._open = Segment(segment_name(number))
        self._tables = []
        self._unindexed = []

    def _load_segments(self) -> None:
        ours = {MANIFEST, INDEX, LOCK}
        foreign = [
            p.name
            for p in self.root.iterdir()
            if not (p.name in ours or is_segment(p.name) or p.name.startswith((".", "_")))
        ]
        if foreign:
            logger.warning(
                "Output folder %s also holds files dask_pcm did not write (%s): "
                "pandas.read_parquet(%s) would read them too; they are left alone",
                self.root,
                ", ".join(sorted(foreign)[:QUOTED_NAMES]),
                self.root,
            )
        segments, changed = reconcile(self.root)
        self._segments = segments
        self._units = {u for s in segments.values() for u in s.units}
        if changed:
            write_atomically(self.root, self.root / INDEX, index_text(segments.values()).encode())
        self._begin_segment()
        self._flushed_at = time.monotonic()

    def _append_index(self, entry: dict[str, Any]) -> None:
        # One short line, appended and fsynced; a run killed half way through it leaves a
        # line that read_index skips, and the segment's footer tells the rest.
        path = self.root / INDEX
        line = memoryview((json.dumps(entry) + "\n").encode())
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                size = os.fstat(fd).st_size
                try:
                    while line:
                        line = line[os.write(fd, line) :]
                    os.fsync(fd)
                except OSError:
                    # Half a line, then the next one appended to it, would hide both.
                    os.ftruncate(fd, size)
                    raise
            finally:
                os.close(fd)
        except OSError as exc:
            raise write_failed(self.root, path, exc) from exc
