"""The output folder of :func:`~dask_pcm.run_fever`: finished units appended to a few segments.

A run that is killed keeps what it finished; rerunning the same command computes only the
missing units, and no row is ever written twice. At the paper's size (145,449 claims x 10
templates, 90,910 units of 16 claims) that must not mean one file per unit: a shared
filesystem's inode quota, and every resume listing them all. What this module does:

- **Only its own folders.** A folder that is not empty and holds no ``_dask_pcm_run.json``
  (say, a Spark or pandas dataset) is refused, naming what is in it; nothing in it is
  renamed, removed or added to. A folder holding only the lock and temporary files of a
  run killed before it wrote its manifest counts as its own.
- **One run at a time.** The folder is locked (``flock`` on ``.dask-pcm-run.lock``, released
  by the kernel when the run's process dies) for the whole run; a second run on the same
  folder fails at once, naming the process that holds it.
- **Provenance, not paths.** ``_dask_pcm_run.json`` records what determines a prediction: the
  model's content digest (for a hub id, its revision), the loader's options, the scoring
  method, the claims per task (they draw the units), the claims' digest and each template's text,
  chat flag and answers. A rerun compares those: the same model by another path resumes;
  anything that changed refuses, naming each difference. Every row carries ``model_digest``.
- **Segments.** Finished units are appended to the open segment
  (:mod:`dask_pcm.fever.segments`); it is written out, atomically and durably, when it
  reaches ``pcm.fever.segment-rows`` rows (and a new one begins), and rewritten whole at least
  every ``pcm.fever.flush-interval`` while it fills, and when the run ends or fails. A killed
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

``pandas.read_parquet(folder)`` reads the predictions: hidden and ``_``-prefixed files are
skipped by pyarrow.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import socket
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dask_pcm import config, locks
from dask_pcm.exceptions import OutputFolderError
from dask_pcm.fever.provenance import differences
from dask_pcm.fever.segments import (
    INDEX,
    UNITS_KEY,
    Segment,
    index_text,
    is_segment,
    reconcile,
    segment_name,
    segment_number,
)
from dask_pcm.fever.segments import read_predictions as read_predictions  # where it was

if TYPE_CHECKING:
    import pyarrow as pa

logger = logging.getLogger(__name__)

FORMAT = "dask-pcm-fever-output/4"
MANIFEST = "_dask_pcm_run.json"
LOCK = ".dask-pcm-run.lock"
# The temporary files _write_atomically names (``.<name>.<pid>.<random>.tmp``).
TEMPORARY = re.compile(r"\..+\.\d+\.[0-9a-f]{8}\.tmp")
# How many of a foreign folder's names an error quotes.
_QUOTED_NAMES = 5


class OutputStore:
    """A locked output folder for one run; use it as a context manager.

    Parameters
    ----------
    root
        The folder (created with its parents if missing).
    provenance
        What determines this run's predictions (see the module docstring); ``model`` in it
        is informative only (how the user named the model), never compared.
    segment_rows, flush_interval
        Default ``pcm.fever.segment-rows`` and ``pcm.fever.flush-interval``.

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
    ) -> None:
        self.root = Path(root)
        self.provenance = {"format": FORMAT, **provenance}
        self.segment_rows = segment_rows or int(config.get("fever.segment-rows"))
        if self.segment_rows < 1:
            raise ValueError(f"pcm.fever.segment-rows must be at least 1, not {self.segment_rows}")
        self.flush_interval = (
            config.fever_flush_interval() if flush_interval is None else flush_interval
        )
        self._lock: int | None = None
        self._segments: dict[str, Segment] = {}
        self._units: set[str] = set()
        self._open = Segment(segment_name(0))
        self._tables: list[pa.Table] = []
        self._unindexed: list[str] = []
        self._flushed_at = time.monotonic()

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
            changed = differences(old, new)
            if changed:
                raise OutputFolderError(
                    f"output folder {self.root} holds predictions of another run: "
                    + "; ".join(changed)
                    + f". Give another folder, or delete {self.root} to start over."
                )
            # Templates of earlier runs stay listed: their parts are still in the folder.
            new = {**new, "templates": {**old["templates"], **new["templates"]}}
        self._write_atomically(manifest, json.dumps(new, indent=1).encode())

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
        if not self._unindexed or time.monotonic() - self._flushed_at < self.flush_interval:
            return False
        self.flush()
        return True

    def flush(self) -> None:
        """Write the open segment (everything added to it so far), then index it."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        self._flushed_at = time.monotonic()
        if not self._unindexed:
            return
        table = pa.concat_tables(self._tables, promote_options="default")
        metadata = {**(table.schema.metadata or {}), UNITS_KEY: json.dumps(self._open.units)}
        buffer = pa.BufferOutputStream()
        pq.write_table(table.replace_schema_metadata(metadata), buffer)
        data = buffer.getvalue().to_pybytes()
        self._write_atomically(self.root / self._open.name, data)
        self._open.bytes = len(data)
        self._segments[self._open.name] = self._open
        self._append_index(self._open.entry(self._unindexed))
        self._unindexed = []

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
                ", ".join(sorted(foreign)[:_QUOTED_NAMES]),
                self.root,
            )
        segments, changed = reconcile(self.root)
        self._segments = segments
        self._units = {u for s in segments.values() for u in s.units}
        if changed:
            self._write_atomically(self.root / INDEX, index_text(segments.values()).encode())
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

    def _write_atomically(self, path: Path, data: bytes) -> None:
        if path.parent != self.root:
            raise OutputFolderError(f"refusing to write {path}: outside {self.root}")
        tmp = self.root / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException as exc:
            tmp.unlink(missing_ok=True)
            if isinstance(exc, OSError):
                raise write_failed(self.root, path, exc) from exc
            raise
        _fsync_directory(self.root)


def _fsync_directory(path: Path) -> None:
    """Make a rename in ``path`` durable (where the filesystem supports it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some network filesystems refuse fsync on a directory
    finally:
        os.close(fd)


def refuse_foreign(root: Path) -> None:
    """Refuse a folder that is not empty and holds no manifest: not written by dask_pcm.

    A run killed between taking the lock and writing the manifest leaves only the lock
    and temporary files; that folder is ours."""
    try:
        names = sorted(os.listdir(root))
    except FileNotFoundError:
        return
    except OSError as exc:
        raise OutputFolderError(f"output folder {root} cannot be listed: {exc}") from exc
    if MANIFEST in names:
        return
    foreign = [n for n in names if n != LOCK and not TEMPORARY.fullmatch(n)]
    if foreign:
        more = len(foreign) - _QUOTED_NAMES
        raise OutputFolderError(
            f"output folder {root} was not written by dask_pcm (no {MANIFEST}) and "
            f"holds {len(foreign)} file(s): {', '.join(foreign[:_QUOTED_NAMES])}"
            + (f" and {more} more" if more > 0 else "")
            + "; give an empty or new folder"
        )


def write_failed(root: Path, path: Path, exc: OSError) -> OutputFolderError:
    """The error for a write of ``path`` that failed: what failed, and how to go on."""
    full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
    reason = f"[Errno {exc.errno}] {exc.strerror}" if exc.strerror else str(exc)
    return OutputFolderError(
        f"output folder {root}: writing {path.name} failed: {reason}. "
        + ("Free space" if full else "Fix that")
        + ", then run the same command again: finished units already written are kept"
    )


def remove_temporary(root: Path) -> None:
    # We hold the lock: our temporary files here belong to runs that died.
    for stale in root.glob(".*.tmp"):
        if TEMPORARY.fullmatch(stale.name):
            stale.unlink(missing_ok=True)
            logger.info("Removed %s, left by a run that did not finish", stale)
