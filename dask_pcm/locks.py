"""Host-wide locks between worker processes, built on ``flock``.

A Dask ``Semaphore`` would need a scheduler round trip and a client on every worker, and a
lease held by a killed worker only expires after a timeout. An ``flock`` on a file in the
host's ``/tmp`` is released by the kernel the moment its holder dies, works before the
worker has registered, and is per host by construction, which is what "one load per host at a
time" means. ``flock`` locks belong to open file descriptions, so two threads of one process
that open the file separately exclude each other too (in-process test clusters rely on that).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from dask_pcm import config

_POLL_SECONDS = 0.05


def lock_dir() -> Path:
    """This host's folder of lock files: ``pcm.lock-directory``, by default
    ``/tmp/dask-pcm-locks-<uid>``.

    In ``/tmp``, not ``$TMPDIR``: batch systems point ``TMPDIR`` at a folder of each job's
    own, where the jobs of one user on a node would not see each other's locks.
    """
    configured = config.get("lock-directory")
    if configured:
        path = Path(configured).expanduser()
    else:
        base = "/tmp" if os.access("/tmp", os.W_OK | os.X_OK) else tempfile.gettempdir()
        path = Path(base) / f"dask-pcm-locks-{os.getuid()}"
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def file_lock(path: str | os.PathLike[str]) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing) for the ``with`` block."""
    fd = os.open(os.fspath(path), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def try_lock(path: str | os.PathLike[str], note: str) -> int:
    """Take an exclusive ``flock`` on ``path`` without waiting; return its descriptor.

    ``note`` (who holds it) is written into the file for the next one to read. Raises
    :class:`BlockingIOError` carrying the holder's note when another process holds it.
    Release with :func:`unlock`.
    """
    fd = os.open(os.fspath(path), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 1024, 0).decode(errors="replace").strip() or "holder unknown"
        os.close(fd)
        raise BlockingIOError(holder) from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, note.encode(), 0)
    return fd


def unlock(fd: int) -> None:
    """Release a lock taken with :func:`try_lock`."""
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


@contextlib.contextmanager
def host_slot(name: str, slots: int = 1) -> Iterator[int]:
    """Take one of ``slots`` host-wide slots called ``name``; yields the slot number.

    Blocks (polling) until a slot is free. Use it in a thread, never on an event loop.
    """
    if slots < 1:
        raise ValueError(f"need at least one slot for {name!r}, got {slots}")
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    fds = []
    try:
        for i in range(slots):
            fds.append(os.open(lock_dir() / f"{safe}.{i}.lock", os.O_RDWR | os.O_CREAT, 0o644))
        while True:
            for i, fd in enumerate(fds):
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue
                try:
                    yield i
                finally:
                    fcntl.flock(fd, fcntl.LOCK_UN)
                return
            time.sleep(_POLL_SECONDS)
    finally:
        for fd in fds:
            os.close(fd)


#: Set while no background import of heavy modules runs in this process (the worker
#: preimport, :mod:`dask_pcm.worker.preimport`, clears it while it imports torch and
#: transformers). Two threads importing transformers at once fail ("partially initialized
#: module"): whatever imports them on a worker waits for it first.
IMPORTS_DONE = threading.Event()
IMPORTS_DONE.set()


def wait_for_imports(timeout: float | None = None) -> bool:
    """Block until no background preimport runs in this process; whether none does."""
    return IMPORTS_DONE.wait(timeout)
