"""A template's copy on a host's local disk: one per host and template, made once.

Copies live in a folder per template digest under the host's template folder
(``pcm.worker.template-directory``; by default beside the workers' own folders, so that the
worker processes of one host share it). Making one happens under a host-wide file lock for
that template, into a hidden staging folder renamed into place when complete
(:class:`~dask_pcm.templates.manifest.TemplateWriter`).

Holding the lock, a worker reuses a complete copy, after verifying every chunk unless this
process made or checked it already, or another process did while this one waited for the
lock: the workers of a host that join at once make one copy and read it once (whoever makes
or checks a copy writes a new *stamp* beside it, and a waiter that sees the stamp change
while it waits trusts the copy). A copy found complete on arrival is read again: a disk
that damaged it changed no stamp. A damaged copy is removed and made again, and staging
folders left by dead processes are removed.

A process using a copy holds a shared ``flock`` on its *users* file (:class:`CopyUse`); the
last one to let go removes the copy, as distributed removes a worker's own folder when it
closes. A process that dies lets go with it (the kernel drops its locks); its copy goes with
the next user's release, or is reused by the next worker of the host.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from dask_pcm.locks import file_lock
from dask_pcm.templates.manifest import MANIFEST_NAME, Manifest, verify_copy

logger = logging.getLogger(__name__)


def local_copy(
    directory: str | Path,
    manifest: Manifest,
    make: Callable[[Path], None],
    trusted: bool = False,
) -> Path:
    """The folder holding ``manifest``'s template under ``directory``, made by ``make(dest)``
    if there is no usable copy yet.

    Parameters
    ----------
    directory
        The host's template folder (created if missing).
    manifest
        The template.
    make
        Assembles the template at the path it is given (e.g. a fetch from peers).
    trusted
        The copy was made or verified by this process: do not verify it again.
    """
    with _usable(Path(directory), manifest, make, trusted) as dest:
        return dest


def use_copy(
    directory: str | Path,
    manifest: Manifest,
    make: Callable[[Path], None],
    trusted: bool = False,
) -> CopyUse:
    """As :func:`local_copy`, and this process's use of the copy taken before the copy's
    lock is let go (so that no last user's release removes it in between)."""
    with _usable(Path(directory), manifest, make, trusted) as dest:
        return CopyUse(dest)


@contextlib.contextmanager
def _usable(
    directory: Path, manifest: Manifest, make: Callable[[Path], None], trusted: bool
) -> Iterator[Path]:
    """A usable copy, under the template's host-wide lock for the ``with`` block."""
    directory.mkdir(parents=True, exist_ok=True)
    dest = directory / manifest.digest[:16]
    stamp = directory / f".{dest.name}.verified"
    before = _read(stamp)
    with file_lock(directory / f".{dest.name}.lock"):
        complete = (dest / MANIFEST_NAME).is_file()
        now = _read(stamp)
        # Made or checked by another process while this one waited for the lock: trusted.
        here = False  # made or checked by this call
        if complete and not trusted and (now is None or now == before):
            bad = verify_copy(dest, manifest)
            here = True
            if bad:
                logger.warning(
                    "Local copy %s has %d chunk(s) that do not match its manifest (e.g. %s): "
                    "making it again",
                    dest,
                    len(bad),
                    bad[:5],
                )
                shutil.rmtree(dest)
                complete = False
        if not complete:
            stamp.unlink(missing_ok=True)
            # We hold the lock: staging folders of this template belong to dead processes.
            for stale in directory.glob(f".{dest.name}.*.partial"):
                shutil.rmtree(stale, ignore_errors=True)
            make(dest)  # every chunk verified as it was written
        if here or not complete:
            _write(stamp, uuid.uuid4().hex)
        yield dest


class CopyUse:
    """This process's use of the copy at ``dest`` (from :func:`local_copy`): a shared
    ``flock`` on the copy's users file while it is held; :meth:`release` lets go and removes
    the copy when no other process of the host uses it.

    Take it right after :func:`local_copy` returned ``dest``: a copy released by its last
    user in between is then made again by the next :func:`local_copy`.
    """

    def __init__(self, dest: str | Path) -> None:
        self.dest = Path(dest)
        self._users = self.dest.parent / f".{self.dest.name}.users"
        self._fd: int | None = os.open(self._users, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self._fd, fcntl.LOCK_SH)

    def release(self) -> bool:
        """Let go; whether the copy was removed (no other user was left). Idempotent."""
        if self._fd is None:
            return False
        os.close(self._fd)  # drops this process's shared lock
        self._fd = None
        name = self.dest.name
        with file_lock(self.dest.parent / f".{name}.lock"):  # no local_copy meanwhile
            fd = os.open(self._users, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return False  # another process uses it
                shutil.rmtree(self.dest, ignore_errors=True)
                (self.dest.parent / f".{name}.verified").unlink(missing_ok=True)
            finally:
                os.close(fd)
        logger.info("Removed template copy %s: its last user let go", self.dest)
        return True


def _read(stamp: Path) -> str | None:
    try:
        return stamp.read_text() or None
    except OSError:
        return None


def _write(stamp: Path, token: str) -> None:
    tmp = stamp.with_name(f"{stamp.name}.{os.getpid()}.tmp")
    tmp.write_text(token)
    os.replace(tmp, stamp)
