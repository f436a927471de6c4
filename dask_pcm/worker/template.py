"""A context's template on one worker: copied to local disk, or read per build.

:class:`WorkerTemplate` does what each level needs of the template (the files a context is
built from: a model, or any tree of files; none for a context with ``template=None``):

- :meth:`~WorkerTemplate.copy` (levels ``full`` and ``partial``): copy it chunk by chunk into
  ``pcm.worker.template-directory`` (one copy per folder and template, shared by the workers
  that use the folder) and serve it to peers. A copy in the workers' scratch space (the
  default folders) is removed by the last worker of the host that used it, when it closes
  (:func:`dask_pcm.templates.local.use_copy`; the worker's
  :class:`~dask_pcm.templates.serve.TemplateStore` holds its use), as distributed removes a
  worker's own folder; one in a folder of the user's choosing stays for the next run
  (:func:`~dask_pcm.templates.local.local_copy`). A template that
  :func:`dask_pcm.register` could hash (a local path, the embedded model) comes with its
  manifest and is copied from peers, else the source; one it could not (a hub id) is listed
  and hashed here and copied from the source, through the same path;
- :meth:`~WorkerTemplate.read_source` (every build at level ``agnostic``): account one read
  of the source, through the host's source reader (a simulated shared filesystem in tests
  and benchmarks).

What it learns (bytes from peers and from the source, corrupted chunks, time) goes into the
context's status record, through its :class:`~dask_pcm.worker.lifecycle.Lifecycle`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dask_pcm import config
from dask_pcm.exceptions import TemplateFetchError
from dask_pcm.templates.fetch import Planner, SourcePlanner, fetch
from dask_pcm.templates.local import host_copy
from dask_pcm.templates.manifest import Manifest, build_manifest
from dask_pcm.templates.reader import source_reader
from dask_pcm.templates.report import FetchReport
from dask_pcm.templates.serve import TemplateStore
from dask_pcm.templates.sources import EMBEDDED
from dask_pcm.templates.tree import TemplateFiles, list_template
from dask_pcm.worker.lifecycle import Lifecycle

if TYPE_CHECKING:
    from distributed import Worker

logger = logging.getLogger(__name__)

# How often a copy in progress updates the bytes it has so far in the status record.
PROGRESS_SECONDS = 1.0


class WorkerTemplate:
    """The template of a context (``lifecycle``'s) on ``worker``.

    Parameters
    ----------
    worker
        The worker (its event loop runs the copy).
    template
        What the user named: a path, a hub id, ``"embedded"``; None for no files.
    manifest
        The template's chunk manifest (JSON) from the client, or None.
    lifecycle
        The context's state on this worker: what the copy learns goes into its record
        (bytes copied so far every second of a copy, then the copy's totals).
    loader
        The context's loader: which files of the template travel is its choice
        (:func:`dask_pcm.templates.tree.list_template`).
    known_stamp
        The stamp of a host copy made by the registering client
        (:class:`~dask_pcm.templates.local.HostCopy`): a copy carrying it is not read
        again to verify it.
    """

    def __init__(
        self,
        worker: Worker,
        template: str | None,
        manifest: str | None,
        lifecycle: Lifecycle,
        loader: Any = None,
        known_stamp: str | None = None,
    ) -> None:
        self.worker = worker
        self.known_stamp = known_stamp
        self.loader = loader
        self.template = template
        self.manifest = manifest
        self.lifecycle = lifecycle
        self.context = lifecycle.get("context")
        self.directory = Path(
            config.get("worker.template-directory")
            or Path(worker.local_directory) / "pcm-templates"
        )

    @property
    def has_files(self) -> bool:
        """Whether the context has a template at all (``template=None`` has none)."""
        return self.template is not None

    def files(self) -> TemplateFiles:
        """The template's files at the source, as the context's loader lists them."""
        if self.template is None:
            raise TemplateFetchError(f"context {self.context!r} has no template files")
        return list_template(self.template, self.loader)

    def copy(self) -> str:
        """Copy the template to local disk and serve it; where the loader should read it."""
        planner: Planner | None = None  # peers, through the scheduler's chunk directory
        if self.manifest is not None:
            manifest = Manifest.from_json(self.manifest)
        else:  # not hashed by the client (a hub id): hash it here, copy from the source
            manifest, _ = build_manifest(self.files())
            planner = SourcePlanner()
        store = TemplateStore.of(self.worker)
        began = time.perf_counter()
        make = lambda dest: self._fetch(manifest, dest, planner)  # noqa: E731
        trusted = manifest.digest in store.held
        scratch = Path(self.worker.local_directory).resolve().parent
        dest, use = host_copy(
            self.directory, scratch, manifest, make, trusted=trusted, known=self.known_stamp
        )
        logger.info(
            "Template of %r on %s: local copy %s ready in %.2f s",
            self.context,
            self.lifecycle.get("worker"),
            dest,
            time.perf_counter() - began,
        )
        store.add(dest, manifest, use)
        location = str(dest / manifest.entry) if manifest.entry else str(dest)
        self.lifecycle.update(
            template_digest=manifest.digest,
            template_held=True,
            template_bytes=manifest.total_bytes,
            location=location,
        )
        return location

    def _fetch(self, manifest: Manifest, dest: Path, planner: Planner | None) -> None:
        source, problem = self._source_root()
        loop = self.worker.loop.asyncio_loop  # type: ignore[attr-defined]
        report = FetchReport()
        life = self.lifecycle
        life.update(template_bytes=manifest.total_bytes)
        before = (life.get("bytes_from_peers"), life.get("bytes_from_source"))
        copying = fetch(self.worker, manifest, dest, source, planner=planner, report=report)
        future = asyncio.run_coroutine_threadsafe(copying, loop)
        try:
            while True:
                try:
                    future.result(timeout=PROGRESS_SECONDS)
                    break
                except concurrent.futures.TimeoutError:
                    self._count(report, before)  # the bytes so far, for status and the page
        except TemplateFetchError as exc:
            if not problem:
                raise
            raise TemplateFetchError(f"{exc}; the source: {problem}") from exc
        self._count(report, before)
        life.add(corrupted_chunks=report.corrupted, fetch_seconds=report.seconds)
        self._log(report)

    def _count(self, report: FetchReport, before: tuple[int, int]) -> None:
        self.lifecycle.update(
            bytes_from_peers=before[0] + report.bytes_from_peers,
            bytes_from_source=before[1] + report.bytes_from_source,
        )

    def _log(self, report: FetchReport) -> None:
        troubled = report.corrupted or report.failed_peers
        logger.log(
            logging.WARNING if troubled else logging.INFO,
            "Template of %r fetched on %s: %d bytes from peers, %d from the source, "
            "%d corrupted chunk(s) discarded, %.2f s; peers: %s",
            self.context,
            self.lifecycle.get("worker"),
            report.bytes_from_peers,
            report.bytes_from_source,
            report.corrupted,
            report.seconds,
            report.describe_peers(),
        )

    def _source_root(self) -> tuple[str | None, str | None]:
        """The folder the manifest's files are relative to, or why there is none."""
        try:
            return str(self.files().root), None
        except Exception as exc:
            return None, f"{type(exc).__name__}: {exc}"

    def measure_source(self) -> None:
        """Record the bytes one build at level ``agnostic`` reads from the source."""
        nbytes = _source_bytes(self) if self.has_files else 0
        self.lifecycle.update(template_bytes=nbytes)

    def read_source(self) -> None:
        """Account one read of the template from the source (every build at ``agnostic``):
        under a simulated shared filesystem it waits for its share of the host's link, as
        a level ``agnostic`` run would on a cluster's shared storage."""
        nbytes = self.lifecycle.get("template_bytes")
        if not nbytes:
            return
        waited = source_reader().account(nbytes)
        self.lifecycle.add(bytes_from_source=nbytes, fetch_seconds=waited)


def _source_bytes(template: WorkerTemplate) -> int:
    """Bytes one build reads from a local template source; 0 for hub ids and other strings."""
    source = template.template
    if not isinstance(source, str) or not (source == EMBEDDED or os.path.exists(source)):
        return 0
    try:
        return sum(p.stat().st_size for p in template.files().paths())
    except Exception:  # the build itself reports an unusable source, with its reason
        return 0
