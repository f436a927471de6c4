"""Serving template chunks to peers: every worker has one :class:`TemplateStore`.

The store (``worker.extensions["dask-pcm-templates"]``) knows the templates the worker holds
complete (and holds its use of each local copy until the worker closes:
:class:`~dask_pcm.templates.local.CopyUse`), and the copies it is still assembling; it
registers the comm handler ``pcm_template_chunk`` (:data:`dask_pcm.protocol.CHUNK_OP`), which
answers ``(digest, index)`` with that chunk read from disk, at most
``pcm.template.max-uploads`` at once (the others wait their turn). A chunk is sent as its own frame (no copy into the message, never pickled).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distributed.protocol import to_serialize

from dask_pcm import config
from dask_pcm.exceptions import ChunkError
from dask_pcm.protocol import CHUNK_OP
from dask_pcm.templates.manifest import Manifest, TemplateWriter, map_chunk

if TYPE_CHECKING:
    from distributed import Worker

    from dask_pcm.templates.local import CopyUse
    from dask_pcm.templates.report import FetchReport

EXTENSION = "dask-pcm-templates"


class TemplateStore:
    """The templates one worker holds complete, by digest, and the handler serving them."""

    def __init__(self, worker: Worker, max_uploads: int | None = None) -> None:
        self.worker = worker
        self.held: dict[str, tuple[Path, Manifest]] = {}
        self.partial: dict[str, TemplateWriter] = {}
        # What the last copy of each template made here did (its chunks' timeline included).
        self.reports: dict[str, FetchReport] = {}
        self._uses: dict[str, CopyUse] = {}
        limit = max_uploads or int(config.get("template.max-uploads"))
        self._uploads = asyncio.Semaphore(limit)
        self.max_uploads = limit
        self.active_uploads = 0
        self.peak_uploads = 0
        self.bytes_served = 0
        worker.handlers[CHUNK_OP] = self.serve

    @classmethod
    def of(cls, worker: Worker) -> TemplateStore:
        """The store of ``worker``, created on first use (on the worker's event loop)."""
        store = worker.extensions.get(EXTENSION)
        if store is None:
            store = worker.extensions[EXTENSION] = cls(worker)
        return store

    def add(self, root: str | Path, manifest: Manifest, use: CopyUse | None = None) -> None:
        """Offer the complete template at ``root`` to peers; ``use``, this worker's use of
        that copy, is held until the worker closes (one per template)."""
        self.held[manifest.digest] = (Path(root), manifest)
        self.partial.pop(manifest.digest, None)
        if use is not None:
            kept = self._uses.setdefault(manifest.digest, use)
            if kept is not use:
                use.release()  # one is held already: the copy stays

    async def close(self) -> None:
        """The worker closes: let go of its local copies (the host's last user removes each;
        in a thread: it waits for the copy's lock, and removing gigabytes takes a while)."""
        uses, self._uses = self._uses, {}
        self.held.clear()
        for use in uses.values():
            await asyncio.to_thread(use.release)

    def add_partial(self, writer: TemplateWriter) -> None:
        """Offer the chunks a template being assembled already has (its writer's staging)."""
        self.partial[writer.manifest.digest] = writer

    def _where(self, digest: str, index: int) -> tuple[Path, Manifest, bool]:
        """Root and manifest holding chunk ``index``, and whether it is a partial copy."""
        held = self.held.get(digest)
        if held is not None:
            return held[0], held[1], False
        writer = self.partial.get(digest)
        if writer is None or index in writer.missing:
            raise ChunkError(
                f"chunk {index} of template {digest[:12]}... is not held by {self.worker.address}"
            )
        return writer.staging, writer.manifest, True

    async def serve(self, digest: str, index: int) -> Any:
        """Comm handler: chunk ``index`` of template ``digest``, mapped from disk."""
        for _ in range(50):
            root, manifest, partial = self._where(digest, index)
            async with self._uploads:
                self.active_uploads += 1
                self.peak_uploads = max(self.peak_uploads, self.active_uploads)
                try:
                    data = await asyncio.to_thread(map_chunk, root, manifest, index)
                except FileNotFoundError:
                    if not partial:
                        raise
                    data = None  # the copy was completed (moved into place) or abandoned
                finally:
                    self.active_uploads -= 1
            if data is not None:
                break
            await asyncio.sleep(0.1)  # look again: complete by now, or gone
        else:
            raise ChunkError(f"chunk {index} of template {digest[:12]}... kept moving; try later")
        self.bytes_served += len(data)
        # As its own frame: the comm sends the array's buffer as it is instead of packing a
        # copy of it into the message, and the peer gets an array over the buffer it read
        # into (a bytes frame would be copied once more there).
        return to_serialize(data)
