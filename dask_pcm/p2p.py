"""Peer-to-peer templates: workers serve the chunks of the templates they hold, and fetch
the templates they lack from peers, verified chunk by chunk, before reading the source.

Every worker has one :class:`TemplateStore` (``worker.extensions["dask-pcm-templates"]``). It
registers the comm handler ``pcm_template_chunk`` on the worker, which answers
``(digest, index)`` with that chunk read from disk, at most ``pcm.template.max-uploads`` at once
(the others wait their turn). :func:`fetch_template` runs on a joining worker: it asks several
peers in parallel for the chunks of a :class:`~dask_pcm.chunks.Manifest`, verifies each
against its SHA-256, writes it into the worker's local copy through a
:class:`~dask_pcm.chunks.TemplateWriter`, and drops a peer that fails (its chunks go to the
others). A chunk that does not match is discarded, counted, and fetched again elsewhere. With
no peer left, the remaining chunks come from the source, read through an optional
:class:`~dask_pcm.throttle.SharedBandwidth` (the simulated shared filesystem). Memory held at
once is bounded by the chunks in flight, never the template's size.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from dask_pcm import config
from dask_pcm.chunks import ChunkError, Manifest, TemplateWriter, read_chunk

if TYPE_CHECKING:
    from distributed import Worker

    from dask_pcm.throttle import SharedBandwidth

logger = logging.getLogger(__name__)

EXTENSION = "dask-pcm-templates"
HANDLER = "pcm_template_chunk"


class TemplateStore:
    """The templates one worker holds complete, by digest, and the handler serving them."""

    def __init__(self, worker: Worker, max_uploads: int | None = None) -> None:
        self.worker = worker
        self.held: dict[str, tuple[Path, Manifest]] = {}
        limit = max_uploads or int(config.get("template.max-uploads", 4))
        self._uploads = asyncio.Semaphore(limit)
        self.max_uploads = limit
        self.active_uploads = 0
        self.peak_uploads = 0
        self.bytes_served = 0
        worker.handlers[HANDLER] = self.serve

    @classmethod
    def of(cls, worker: Worker) -> TemplateStore:
        """The store of ``worker``, created on first use (on the worker's event loop)."""
        store = worker.extensions.get(EXTENSION)
        if store is None:
            store = worker.extensions[EXTENSION] = cls(worker)
        return store

    def add(self, root: str | Path, manifest: Manifest) -> None:
        """Offer the complete template at ``root`` to peers."""
        self.held[manifest.digest] = (Path(root), manifest)

    async def serve(self, digest: str, index: int) -> bytes:
        """Comm handler: chunk ``index`` of template ``digest``, read from disk."""
        held = self.held.get(digest)
        if held is None:
            raise ChunkError(f"template {digest[:12]}... is not held by {self.worker.address}")
        root, manifest = held
        async with self._uploads:
            self.active_uploads += 1
            self.peak_uploads = max(self.peak_uploads, self.active_uploads)
            try:
                data = await asyncio.to_thread(read_chunk, root, manifest, index)
            finally:
                self.active_uploads -= 1
        self.bytes_served += len(data)
        return data


@dataclass
class FetchReport:
    """Where the bytes of one template fetch came from."""

    bytes_from_peers: int = 0
    bytes_from_source: int = 0
    chunks_from_peers: int = 0
    chunks_from_source: int = 0
    corrupted: int = 0
    failed_peers: list[str] = field(default_factory=list)
    seconds: float = 0.0


async def fetch_template(
    worker: Worker,
    manifest: Manifest,
    dest: str | Path,
    peers: list[str],
    source_root: str | Path | None,
    bandwidth: SharedBandwidth | None = None,
    per_peer: int = 2,
) -> tuple[Path, FetchReport]:
    """Assemble ``manifest``'s template at ``dest`` from ``peers``, else from the source.

    Runs on ``worker``'s event loop. Each peer gets at most ``per_peer`` requests at once;
    chunks whose peer fails or sends bad bytes go back in the queue for another peer (or the
    source when no peer is left). Raises :class:`ChunkError` when a chunk cannot be had from
    anywhere (no peers left and no readable source).
    """
    report = FetchReport()
    start = time.perf_counter()
    writer = await asyncio.to_thread(TemplateWriter, manifest, dest)
    queue: deque[int] = deque(range(manifest.nchunks))
    live = [p for p in dict.fromkeys(peers) if p != worker.address]
    strikes: dict[str, int] = {}

    async def from_peer(peer: str) -> None:
        while queue and peer in live:
            index = queue.popleft()
            try:
                data = await worker.rpc(peer).pcm_template_chunk(
                    digest=manifest.digest, index=index
                )
            except Exception as exc:  # a dead or confused peer: give its chunk to others
                queue.appendleft(index)
                if peer in live:
                    live.remove(peer)
                    report.failed_peers.append(peer)
                    logger.warning("Template peer %s failed (%r); using others", peer, exc)
                return
            try:
                await asyncio.to_thread(writer.write, index, data)
            except ChunkError as exc:
                report.corrupted += 1
                queue.append(index)
                strikes[peer] = strikes.get(peer, 0) + 1
                logger.warning("Discarded a corrupted chunk from %s: %s", peer, exc)
                if strikes[peer] >= 3 and peer in live:
                    live.remove(peer)
                    report.failed_peers.append(peer)
                continue
            report.bytes_from_peers += len(data)
            report.chunks_from_peers += 1

    try:
        if live:
            await asyncio.gather(*(from_peer(p) for _ in range(per_peer) for p in list(live)))
        while queue:
            if source_root is None:
                raise ChunkError(
                    f"{len(queue)} chunk(s) of template {manifest.digest[:12]}... could not be "
                    "fetched from any peer and no source was given"
                )
            index = queue.popleft()
            length = manifest.chunk(index).length
            if bandwidth is not None:
                await asyncio.to_thread(bandwidth.consume, length)
            data = await asyncio.to_thread(read_chunk, source_root, manifest, index)
            await asyncio.to_thread(writer.write, index, data)
            report.bytes_from_source += len(data)
            report.chunks_from_source += 1
        path = await asyncio.to_thread(writer.finish)
    except BaseException:
        await asyncio.to_thread(writer.abort)
        raise
    report.seconds = time.perf_counter() - start
    return path, report
