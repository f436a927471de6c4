"""A template's copy on a worker's local disk: one per host and template, made once.

Copies live in a folder per template digest under ``pcm.worker.template-directory``. Making
one happens under a host-wide file lock for that template (worker processes of one host share
the folder), into a hidden staging folder renamed into place when complete
(:class:`~dask_pcm.templates.manifest.TemplateWriter`). Holding the lock, a worker reuses a
complete copy, after verifying every chunk unless this process made or checked it already; a
damaged one is removed and made again, and staging folders left by dead processes are removed.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
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
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    dest = directory / manifest.digest[:16]
    with file_lock(directory / f".{dest.name}.lock"):
        complete = (dest / MANIFEST_NAME).is_file()
        if complete and not trusted:
            bad = verify_copy(dest, manifest)
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
            # We hold the lock: staging folders of this template belong to dead processes.
            for stale in directory.glob(f".{dest.name}.*.partial"):
                shutil.rmtree(stale, ignore_errors=True)
            make(dest)
    return dest
