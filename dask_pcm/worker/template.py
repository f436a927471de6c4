"""A context's template on one worker: copied to local disk, staged, or read per build.

:class:`WorkerTemplate` does what each level needs of the template (the model files):

- :meth:`~WorkerTemplate.copy` (levels ``full`` and ``partial``, a template with a chunk
  manifest): copy it chunk by chunk from peers, else the source, into
  ``pcm.worker.template-directory`` (one copy per host and template, under a file lock), and
  offer it to peers; a copy left there by an earlier worker is verified first;
- :meth:`~WorkerTemplate.stage` (level ``partial``, a template without a manifest: a hub id):
  copy its files once from the source;
- :meth:`~WorkerTemplate.read_source` (every build at level ``agnostic``): account one read
  of the source, through the simulated shared filesystem when one is configured.

What it learns (bytes from peers and from the source, corrupted chunks, time) goes into the
context's status record.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import dask.utils

from dask_pcm import config
from dask_pcm.chunks import MANIFEST_NAME, Manifest, verify_copy
from dask_pcm.exceptions import TemplateFetchError
from dask_pcm.locks import file_lock
from dask_pcm.p2p import TemplateStore, fetch_coordinated, fetch_template
from dask_pcm.protocol import ContextStatus
from dask_pcm.sources import resolve_source, stage_template, template_files

if TYPE_CHECKING:
    import threading

    from distributed import Worker

logger = logging.getLogger(__name__)


class WorkerTemplate:
    """The template of context ``record.context`` on ``worker``.

    Parameters
    ----------
    worker
        The worker (its event loop runs the copy).
    template
        What the user named: a path, a hub id, ``"embedded"``.
    manifest
        The template's chunk manifest (JSON), or None where it cannot travel peer to peer.
    record, lock
        The context's status record on this worker, and the lock that guards it.
    """

    def __init__(
        self,
        worker: Worker,
        template: str | None,
        manifest: str | None,
        record: ContextStatus,
        lock: threading.Lock,
    ) -> None:
        self.worker = worker
        self.template = template
        self.manifest = manifest
        self.record = record
        self.lock = lock
        self.directory = Path(
            config.get("worker.template-directory")
            or Path(worker.local_directory) / "pcm-templates"
        )

    def copy(self) -> str:
        """Copy the template to local disk (peers first) and serve it; where it now is."""
        assert self.manifest is not None
        manifest = Manifest.from_json(self.manifest)
        self.directory.mkdir(parents=True, exist_ok=True)
        dest = self.directory / manifest.digest[:16]
        store = TemplateStore.of(self.worker)
        with file_lock(self.directory / f".{manifest.digest[:16]}.lock"):
            if (dest / MANIFEST_NAME).is_file() and manifest.digest not in store.held:
                self._drop_if_damaged(dest, manifest)
            if not (dest / MANIFEST_NAME).is_file():
                self._fetch(manifest, dest)
        store.add(dest, manifest)
        single = manifest.files[0].path if len(manifest.files) == 1 else ""
        location = str(dest / single) if single.lower().endswith(".gguf") else str(dest)
        with self.lock:
            self.record.template_digest = manifest.digest
            self.record.template_held = True
            self.record.template_bytes = manifest.total_bytes
            self.record.location = location
        return location

    def _drop_if_damaged(self, dest: Path, manifest: Manifest) -> None:
        bad = verify_copy(dest, manifest)
        if bad:
            logger.warning(
                "Local copy %s of the template of %r has %d chunk(s) that do not match its "
                "manifest (e.g. %s): fetching it again",
                dest,
                self.record.context,
                len(bad),
                bad[:5],
            )
            shutil.rmtree(dest)

    def _fetch(self, manifest: Manifest, dest: Path) -> None:
        source, problem = self._source_root()
        loop = self.worker.loop.asyncio_loop  # type: ignore[attr-defined]
        future = asyncio.run_coroutine_threadsafe(self._fetch_async(manifest, dest, source), loop)
        try:
            _, report = future.result()
        except TemplateFetchError as exc:
            if not problem:
                raise
            raise TemplateFetchError(f"{exc}; the source: {problem}") from exc
        with self.lock:
            self.record.bytes_from_peers += report.bytes_from_peers
            self.record.bytes_from_source += report.bytes_from_source
            self.record.corrupted_chunks += report.corrupted
            self.record.fetch_seconds += report.seconds
        troubled = report.corrupted or report.failed_peers
        logger.log(
            logging.WARNING if troubled else logging.INFO,
            "Template of %r fetched on %s: %d bytes from peers, %d from the source, "
            "%d corrupted chunk(s) discarded, %.2f s; peers: %s",
            self.record.context,
            self.record.worker,
            report.bytes_from_peers,
            report.bytes_from_source,
            report.corrupted,
            report.seconds,
            report.describe_peers(),
        )

    async def _fetch_async(self, manifest: Manifest, dest: Path, source: str | None) -> Any:
        bandwidth = config.source_bandwidth()
        if config.get("template.peer-to-peer", True):
            return await fetch_coordinated(self.worker, manifest, dest, source, bandwidth)
        return await fetch_template(self.worker, manifest, dest, [], source, bandwidth)

    def _source_root(self) -> tuple[str | None, str | None]:
        """The folder the manifest's files are relative to, or why there is none."""
        try:
            resolved = resolve_source(self.template)
        except Exception as exc:
            return None, f"{type(exc).__name__}: {exc}"
        root = resolved.path.parent if resolved.kind == "gguf" else resolved.path
        return str(root), None

    def stage(self) -> str:
        """Copy the template's files once from the source; where they now are."""
        staged = stage_template(self.template, self.directory)
        with self.lock:
            self.record.location = str(staged.path)
            self.record.template_bytes = staged.nbytes
        logger.info(
            "Template of %r %s at %s (%d bytes)",
            self.record.context,
            "copied" if staged.copied else "reused",
            staged.path,
            staged.nbytes,
        )
        return str(staged.path)

    def measure_source(self) -> None:
        """Record the bytes one build at level ``agnostic`` reads from the source."""
        with self.lock:
            self.record.template_bytes = _source_bytes(self.template)

    def read_source(self) -> None:
        """Account one read of the template from the source (every build at ``agnostic``).

        Under a simulated shared filesystem (``pcm.template.source-bandwidth``) the read waits
        for its share of the host's link, chunk by chunk like a template copy, so a level
        ``agnostic`` run pays for its repeated reads as it would on a cluster's shared storage.
        """
        nbytes = self.record.template_bytes
        if not nbytes:
            return
        waited = 0.0
        bandwidth = config.source_bandwidth()
        if bandwidth is not None:
            chunk = int(dask.utils.parse_bytes(config.get("template.chunk-size")))
            for start in range(0, nbytes, chunk):
                waited += bandwidth.consume(min(chunk, nbytes - start))
        with self.lock:
            self.record.bytes_from_source += nbytes
            self.record.fetch_seconds += waited


def _source_bytes(template: Any) -> int:
    """Bytes one build reads from a local template source; 0 for hub ids and custom sources."""
    if not isinstance(template, str) or not (template == "embedded" or os.path.exists(template)):
        return 0
    try:
        return sum(p.stat().st_size for p in template_files(resolve_source(template)))
    except Exception:  # the build itself reports an unusable source, with its reason
        return 0
