"""The output folder of :func:`~dask_pcm.run_fever`: one Parquet file per finished unit.

A run that is killed keeps what it finished; rerunning the same command computes only the
missing units, and no row is ever written twice. What that needs, and what this module does:

- **One run at a time.** The folder is locked (``flock`` on ``.dask-pcm-run.lock``, released
  by the kernel when the run's process dies) for the whole run; a second run on the same
  folder fails at once, naming the process that holds it.
- **Provenance, not paths.** ``_dask_pcm_run.json`` records what determines a prediction: the
  model's content digest (for a hub id, its revision), the loader's options, the scoring
  method, the claims per task (they draw the units), the claims' digest and each template's text,
  chat flag and answers. A rerun compares those: the same model by another path resumes;
  anything that changed refuses, naming each difference. Every row carries ``model_digest``.
- **Atomic parts.** Each unit is written to a hidden temporary file of its own (process id and
  a random suffix), flushed and fsynced, then renamed into place; the folder is fsynced after
  the rename. Temporary files left by a killed run are removed when the next run takes the
  lock; a part that cannot be read (or holds the wrong number of rows) is set aside under a
  hidden name, with a warning, and its unit computed again.

``pandas.read_parquet(folder)`` reads the predictions: hidden and ``_``-prefixed files are
skipped by pyarrow.
"""

from __future__ import annotations

import io
import json
import logging
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any

from dask_pcm import locks
from dask_pcm.exceptions import OutputFolderError

logger = logging.getLogger(__name__)

FORMAT = "dask-pcm-fever-output/3"
MANIFEST = "_dask_pcm_run.json"
LOCK = ".dask-pcm-run.lock"
# What must match for a folder to be resumed (``templates`` is compared per template).
COMPARED = ("model_digest", "loader", "method", "claims_per_task", "claims")


class OutputStore:
    """A locked output folder for one run; use it as a context manager.

    Parameters
    ----------
    root
        The folder (created with its parents if missing).
    provenance
        What determines this run's predictions (see the module docstring); ``model`` in it
        is informative only (how the user named the model), never compared.

    Example
    -------
    >>> with OutputStore(Path("preds.parquet"), provenance) as store:   # doctest: +SKIP
    ...     todo = [u for u in units if u not in store.done(sizes)]
    """

    def __init__(self, root: str | os.PathLike[str], provenance: dict[str, Any]) -> None:
        self.root = Path(root)
        self.provenance = {"format": FORMAT, **provenance}
        self._lock: int | None = None

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
        try:
            self._remove_temporary()
            self._check_provenance()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._lock is not None:
            locks.unlock(self._lock)
            self._lock = None

    def _remove_temporary(self) -> None:
        # We hold the lock: temporary files here belong to runs that died.
        for stale in self.root.glob(".*.tmp"):
            stale.unlink(missing_ok=True)
            logger.info("Removed %s, left by a run that did not finish", stale)

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
            differences = _differences(old, new)
            if differences:
                raise OutputFolderError(
                    f"output folder {self.root} holds predictions of another run: "
                    + "; ".join(differences)
                    + f". Give another folder, or delete {self.root} to start over."
                )
            # Templates of earlier runs stay listed: their parts are still in the folder.
            new = {**new, "templates": {**old["templates"], **new["templates"]}}
        self._write_atomically(manifest, json.dumps(new, indent=1).encode())

    def done(self, sizes: dict[str, int]) -> set[str]:
        """The units of ``sizes`` (unit name -> its number of rows) already written.

        A part that cannot be read or has the wrong number of rows is set aside as
        ``.<name>.parquet.unreadable-<time>`` (with a warning) and not counted as done.
        """
        import pyarrow.parquet as pq

        finished = set()
        for path in self.root.glob("*.parquet"):
            name = path.stem
            if name not in sizes:
                continue  # a unit of another template or batch drawing, kept as it is
            try:
                rows = pq.read_metadata(path).num_rows
                problem = None if rows == sizes[name] else f"{rows} rows, expected {sizes[name]}"
            except Exception as exc:  # pyarrow raises several kinds for damaged files
                problem = f"{type(exc).__name__}: {exc}"
            if problem is None:
                finished.add(name)
                continue
            aside = path.with_name(f".{path.name}.unreadable-{time.strftime('%Y%m%dT%H%M%S')}")
            os.replace(path, aside)
            logger.warning(
                "Output part %s cannot be used (%s): set aside as %s; its unit is computed again",
                path,
                problem,
                aside.name,
            )
        return finished

    def write(self, name: str, rows: list[dict[str, Any]]) -> None:
        """Write one unit's rows as ``<name>.parquet``, atomically and durably."""
        import pandas as pd

        buffer = io.BytesIO()
        pd.DataFrame(rows).to_parquet(buffer, index=False)
        self._write_atomically(self.root / f"{name}.parquet", buffer.getvalue())

    def read(self, names: list[str]) -> list[dict[str, Any]]:
        """The rows of the units ``names``, in that order."""
        import pandas as pd

        frames = [pd.read_parquet(self.root / f"{n}.parquet") for n in names]
        return pd.concat(frames, ignore_index=True).to_dict("records") if frames else []

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
        except BaseException:
            tmp.unlink(missing_ok=True)
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


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return text if len(text) <= 60 else text[:57] + "..."


def _differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What differs between the provenance of the folder (``old``) and of this run."""
    if old.get("format") != new["format"]:
        return [
            f"it was written by another version of dask_pcm (format {old.get('format')!r}, "
            f"this one writes {new['format']!r})"
        ]
    out = []
    for key in COMPARED:
        if old.get(key) != new.get(key):
            detail = f"{key} differs (folder: {_short(old.get(key))}, now: {_short(new.get(key))})"
            if key == "model_digest":
                detail += (
                    f" - model files changed: {old.get('model')!r} then, {new.get('model')!r} now"
                )
            out.append(detail)
    before = old.get("templates", {})
    for name, spec in new["templates"].items():
        if name in before and before[name] != spec:
            fields = sorted(k for k in spec if before[name].get(k) != spec[k])
            out.append(f"template {name!r} changed ({', '.join(fields)})")
    return out
