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

A stamp can also be handed on: a process that made a copy writes the stamp it was given
(``token``), and a worker told that stamp (``known``) trusts a copy that still carries it.
That is how a run's client makes the host's copy while its local cluster starts
(:class:`HostCopy`) without its workers reading it all again.

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
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from dask_pcm.locks import file_lock
from dask_pcm.templates.manifest import MANIFEST_NAME, Manifest, TemplateWriter, verify_copy
from dask_pcm.templates.reader import source_reader

logger = logging.getLogger(__name__)


def local_copy(
    directory: str | Path,
    manifest: Manifest,
    make: Callable[[Path], None],
    trusted: bool = False,
    known: str | None = None,
    token: str | None = None,
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
    known
        A stamp written by a process that made or verified the copy (:class:`HostCopy`'s):
        a copy carrying it is not verified again.
    token
        The stamp to write if this call makes or verifies the copy (default: a new one).
    """
    with _usable(Path(directory), manifest, make, trusted, known, token) as dest:
        return dest


def use_copy(
    directory: str | Path,
    manifest: Manifest,
    make: Callable[[Path], None],
    trusted: bool = False,
    known: str | None = None,
    token: str | None = None,
) -> CopyUse:
    """As :func:`local_copy`, and this process's use of the copy taken before the copy's
    lock is let go (so that no last user's release removes it in between)."""
    with _usable(Path(directory), manifest, make, trusted, known, token) as dest:
        return CopyUse(dest)


def host_copy(
    directory: str | Path,
    scratch: str | Path,
    manifest: Manifest,
    make: Callable[[Path], None],
    trusted: bool = False,
    known: str | None = None,
    token: str | None = None,
) -> tuple[Path, CopyUse | None]:
    """The host's copy in ``directory``, and this process's use of it where the copy lives
    in the workers' scratch space ``scratch`` (removed by its last user); a folder of the
    user's choosing keeps its copy for the next run (no use taken)."""
    if Path(directory).resolve().is_relative_to(Path(scratch).resolve()):
        use = use_copy(directory, manifest, make, trusted, known, token)
        return use.dest, use
    return local_copy(directory, manifest, make, trusted, known, token), None


@contextlib.contextmanager
def _usable(
    directory: Path,
    manifest: Manifest,
    make: Callable[[Path], None],
    trusted: bool,
    known: str | None = None,
    token: str | None = None,
) -> Iterator[Path]:
    """A usable copy, under the template's host-wide lock for the ``with`` block."""
    directory.mkdir(parents=True, exist_ok=True)
    dest = directory / manifest.digest[:16]
    stamp = directory / f".{dest.name}.verified"
    before = _read(stamp)
    with file_lock(directory / f".{dest.name}.lock"):
        complete = (dest / MANIFEST_NAME).is_file()
        now = _read(stamp)
        # Made or checked by another process while this one waited for the lock, or by
        # the process that told this one its stamp: trusted.
        here = False  # made or checked by this call
        vouched = now is not None and now == known
        if complete and not trusted and not vouched and (now is None or now == before):
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
            _write(stamp, token or uuid.uuid4().hex)
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


class HostCopy:
    """The host's copy of one template, made by this process from the source: what a run's
    client does while the local cluster it started comes up, so that the copy is ready when
    its first worker asks, instead of being made then.

    :meth:`make` (in a thread) makes or finds the copy, as a worker does, and writes
    :attr:`token` as its stamp; :func:`host_stamp` hands the token to the workers' context
    plugins, which then trust a copy still carrying it (no second read of every byte).
    This process holds a use of the copy (:class:`CopyUse`, in the scratch space) until
    :meth:`release`, which comes after its cluster closed. A copy that fails is logged and
    forgotten: the workers then make theirs as they would have. :meth:`cancel` stops a
    copy still running at its next chunk (a run that ends early does not wait for it).
    """

    def __init__(
        self, manifest: Manifest, root: str | Path, directory: str | Path, scratch: str | Path
    ) -> None:
        self.manifest = manifest
        self.root = Path(root)
        self.directory = Path(directory)
        self.scratch = Path(scratch)
        self.token = uuid.uuid4().hex
        self.use: CopyUse | None = None
        self._cancelled = threading.Event()
        with _HOST_COPIES_LOCK:
            _HOST_COPIES.setdefault(manifest.digest, self)

    def make(self) -> None:
        """Make or find the host's copy; never raises (see the class docstring)."""
        began = time.perf_counter()
        try:
            dest, self.use = host_copy(
                self.directory, self.scratch, self.manifest, self._from_source, token=self.token
            )
        except _Cancelled:
            self._forget()
            logger.info("Host copy of %s cancelled: the run ended first", self.root)
            return
        except Exception as exc:
            self._forget()
            logger.warning(
                "Could not make the host copy of template %s from %s (%s: %s); the workers "
                "make it themselves",
                self.manifest.digest[:16],
                self.root,
                type(exc).__name__,
                exc,
            )
            return
        logger.info(
            "Host copy %s of %s made or found by this process in %.2f s",
            dest,
            self.root,
            time.perf_counter() - began,
        )

    def _from_source(self, dest: Path) -> None:
        writer = TemplateWriter(self.manifest, dest)
        try:
            reader = source_reader()
            for index in range(self.manifest.nchunks):
                if self._cancelled.is_set():
                    raise _Cancelled
                writer.write(index, reader.read(self.root, self.manifest, index))
            writer.finish()
        except BaseException:
            writer.abort()
            raise

    def cancel(self) -> None:
        """Stop a copy still being made, at its next chunk (its staging folder removed)."""
        self._cancelled.set()

    def release(self) -> None:
        """Let go of the copy (removed if no worker of the host still uses it)."""
        self._forget()
        if self.use is not None:
            self.use.release()
            self.use = None

    def _forget(self) -> None:
        with _HOST_COPIES_LOCK:
            if _HOST_COPIES.get(self.manifest.digest) is self:
                del _HOST_COPIES[self.manifest.digest]


class _Cancelled(Exception):
    pass


_HOST_COPIES: dict[str, HostCopy] = {}  # by template digest: copies this process makes
_HOST_COPIES_LOCK = threading.Lock()


def host_stamp(digest: str) -> str | None:
    """The stamp of the host copy of template ``digest`` that this process makes or made
    and still holds (:class:`HostCopy`), else None."""
    with _HOST_COPIES_LOCK:
        made = _HOST_COPIES.get(digest)
    return None if made is None else made.token


def _read(stamp: Path) -> str | None:
    try:
        return stamp.read_text() or None
    except OSError:
        return None


def _write(stamp: Path, token: str) -> None:
    tmp = stamp.with_name(f"{stamp.name}.{os.getpid()}.tmp")
    tmp.write_text(token)
    os.replace(tmp, stamp)
