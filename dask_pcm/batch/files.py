"""The files of an output folder besides its segments: whose folder it is, atomic writes,
what a failed write says, leftovers of killed runs, and the list of failed units."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from dask_pcm.exceptions import OutputFolderError

logger = logging.getLogger(__name__)

#: Units that failed in the last run that tried them (one JSON object per line).
ERRORS = "_dask_pcm_errors.jsonl"
MANIFEST = "_dask_pcm_run.json"
LOCK = ".dask-pcm-run.lock"
# The temporary files write_atomically names (``.<name>.<pid>.<random>.tmp``).
TEMPORARY = re.compile(r"\..+\.\d+\.[0-9a-f]{8}\.tmp")
# How many of a foreign folder's names an error quotes.
QUOTED_NAMES = 5


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
        more = len(foreign) - QUOTED_NAMES
        raise OutputFolderError(
            f"output folder {root} was not written by dask_pcm (no {MANIFEST}) and "
            f"holds {len(foreign)} file(s): {', '.join(foreign[:QUOTED_NAMES])}"
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


def read_errors(path: Path) -> dict[str, dict[str, Any]]:
    """The failed units listed in ``path`` (:data:`ERRORS`); a line cut short by a kill is
    skipped."""
    out: dict[str, dict[str, Any]] = {}
    try:
        text = path.read_text()
    except FileNotFoundError:
        return out
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("unit"), str):
            out[record["unit"]] = record
    return out


@contextlib.contextmanager
def atomic_file(root: Path, path: Path, mode: str = "wb") -> Iterator[IO[Any]]:
    """A file of ``root`` written whole or not at all, durably: a hidden temporary file (named
    so that the next run removes one a kill left), fsynced, renamed into place, the folder
    fsynced; a failure raises :class:`~dask_pcm.exceptions.OutputFolderError` saying how to
    go on."""
    if path.parent != root:
        raise OutputFolderError(f"refusing to write {path}: outside {root}")
    tmp = root / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    text = {} if "b" in mode else {"encoding": "utf-8"}
    try:
        with open(tmp, mode, **text) as f:  # type: ignore[call-overload]
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise write_failed(root, path, exc) from exc
        raise
    _fsync_directory(root)


def write_atomically(root: Path, path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` in ``root`` with :func:`atomic_file`."""
    with atomic_file(root, path) as f:
        f.write(data)
