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
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distributed.protocol import to_serialize

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
        self.partial: dict[str, TemplateWriter] = {}
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
        self.partial.pop(manifest.digest, None)

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
        """Comm handler: chunk ``index`` of template ``digest``, read from disk."""
        for _ in range(50):
            root, manifest, partial = self._where(digest, index)
            async with self._uploads:
                self.active_uploads += 1
                self.peak_uploads = max(self.peak_uploads, self.active_uploads)
                try:
                    data = await asyncio.to_thread(read_chunk, root, manifest, index)
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
        # As its own frame: the comm sends the buffer as it is instead of packing a copy of
        # it into the message.
        return to_serialize(data)


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


class _PeerFailed(Exception):
    """A peer could not be reached or answered with an error."""


async def _ask_peer(worker: Worker, peer: str, digest: str, index: int) -> Any:
    """One chunk from ``peer``, connecting within ``pcm.template.peer-connect-timeout``.

    distributed retries a refused connection for ``distributed.comm.timeouts.connect``
    (30 s by default): far too long to find out that a peer was preempted when the
    source or other peers could serve the chunk now.
    """
    from dask.utils import parse_timedelta
    from distributed.core import send_recv

    timeout = parse_timedelta(config.get("template.peer-connect-timeout", "5s"))
    comm = await worker.rpc.connect(peer, timeout=timeout)
    try:
        data = await send_recv(comm, op=HANDLER, digest=digest, index=index)
    except BaseException:
        comm.abort()
        raise
    worker.rpc.reuse(peer, comm)
    return data


class _Chunks:
    """Getting single chunks into a :class:`TemplateWriter`, from a peer or the source."""

    def __init__(
        self,
        worker: Worker,
        writer: TemplateWriter,
        report: FetchReport,
        source_root: str | Path | None,
        bandwidth: SharedBandwidth | None,
    ) -> None:
        self.worker = worker
        self.writer = writer
        self.manifest = writer.manifest
        self.report = report
        self.source_root = source_root
        self.bandwidth = bandwidth

    async def from_peer(self, peer: str, index: int) -> bool:
        """Fetch, verify and write chunk ``index`` from ``peer``; False if it was corrupted.

        Raises :class:`_PeerFailed` when the peer cannot be reached or errs.
        """
        try:
            data = await _ask_peer(self.worker, peer, self.manifest.digest, index)
        except Exception as exc:
            raise _PeerFailed(f"{peer}: {exc!r}") from exc
        data = getattr(data, "data", data)  # in-process comms hand over the wrapper itself
        try:
            await asyncio.to_thread(self.writer.write, index, data)
        except ChunkError as exc:
            self.report.corrupted += 1
            logger.warning("Discarded a corrupted chunk from %s: %s", peer, exc)
            return False
        self.report.bytes_from_peers += len(data)
        self.report.chunks_from_peers += 1
        return True

    async def from_source(self, index: int) -> None:
        if self.source_root is None:
            raise ChunkError(
                f"chunk {index} of template {self.manifest.digest[:12]}... could not be "
                "fetched from any peer and no source was given"
            )
        if self.bandwidth is not None:
            await asyncio.to_thread(self.bandwidth.consume, self.manifest.chunk(index).length)
        data = await asyncio.to_thread(read_chunk, self.source_root, self.manifest, index)
        await asyncio.to_thread(self.writer.write, index, data)
        self.report.bytes_from_source += len(data)
        self.report.chunks_from_source += 1


async def fetch_coordinated(
    worker: Worker,
    manifest: Manifest,
    dest: str | Path,
    source_root: str | Path | None,
    bandwidth: SharedBandwidth | None = None,
    in_flight: int = 4,
) -> tuple[Path, FetchReport]:
    """Assemble a template with the scheduler's chunk directory, sharing as chunks arrive.

    In rounds: ask the scheduler plugin for a plan (``pcm_chunk_plan``: peers for every
    missing chunk someone holds, partial copies included, and a source lease for at most a
    couple of chunks nobody holds or is reading), get those chunks (``in_flight`` at once),
    report each one held (``pcm_chunk_have``), and serve the chunks held so far to others.
    Workers that join together thus split the source between them and exchange the rest,
    instead of each reading the whole template from it.
    """
    report = FetchReport()
    start = time.perf_counter()
    writer = await asyncio.to_thread(TemplateWriter, manifest, dest)
    store = TemplateStore.of(worker)
    store.add_partial(writer)
    chunks = _Chunks(worker, writer, report, source_root, bandwidth)
    gate = asyncio.Semaphore(in_flight)
    digest, me = manifest.digest, worker.address

    async def get(index: int, planned: list[str]) -> None:
        async with gate:
            # A peer that failed once in this fetch (preempted, most likely) is not asked
            # again; the scheduler forgets it once it notices the worker is gone. If only
            # such peers hold the chunk, it comes from the source rather than never.
            peers = [p for p in planned if p not in report.failed_peers]
            for peer in peers:
                try:
                    if await chunks.from_peer(peer, index):
                        break
                except _PeerFailed as exc:
                    if peer not in report.failed_peers:
                        report.failed_peers.append(peer)
                        logger.warning("%s: template peer failed (%s); using others", me, exc)
                    await worker.scheduler.pcm_chunk_have(
                        digest=digest, worker=peer, indexes=[], lost=[index]
                    )
            else:
                if peers:
                    return  # nobody delivered: planned again next round
                try:
                    await chunks.from_source(index)
                finally:
                    if index in writer.missing:
                        await worker.scheduler.pcm_chunk_have(
                            digest=digest, worker=me, indexes=[], released=[index]
                        )
            await worker.scheduler.pcm_chunk_have(digest=digest, worker=me, indexes=[index])

    try:
        while writer.missing:
            plan = await worker.scheduler.pcm_chunk_plan(
                digest=digest, worker=me, missing=sorted(writer.missing)
            )
            work = [get(int(i), list(peers)) for i, peers in plan["peers"].items()]
            work += [get(int(i), []) for i in plan["source"]]
            if work:
                await asyncio.gather(*work)
            else:
                await asyncio.sleep(0.05)  # every chunk left is being read by someone else
        path = await asyncio.to_thread(writer.finish)
        store.add(path, manifest)
    except BaseException:
        store.partial.pop(digest, None)
        held = sorted(set(range(manifest.nchunks)) - writer.missing)
        await asyncio.to_thread(writer.abort)
        with contextlib.suppress(Exception):
            await worker.scheduler.pcm_chunk_have(digest=digest, worker=me, indexes=[], lost=held)
        raise
    report.seconds = time.perf_counter() - start
    return path, report


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
    chunks = _Chunks(worker, writer, report, source_root, bandwidth)
    queue: deque[int] = deque(range(manifest.nchunks))
    live = [p for p in dict.fromkeys(peers) if p != worker.address]
    strikes: dict[str, int] = {}

    def drop(peer: str) -> None:
        if peer in live:
            live.remove(peer)
            report.failed_peers.append(peer)

    async def from_peer(peer: str) -> None:
        while queue and peer in live:
            index = queue.popleft()
            try:
                if await chunks.from_peer(peer, index):
                    continue
            except _PeerFailed as exc:  # a dead or confused peer: give its chunk to others
                queue.appendleft(index)
                drop(peer)
                logger.warning("Template peer failed (%s); using others", exc)
                return
            queue.append(index)  # corrupted: fetched again, elsewhere if this peer persists
            strikes[peer] = strikes.get(peer, 0) + 1
            if strikes[peer] >= 3:
                drop(peer)

    try:
        if live:
            await asyncio.gather(*(from_peer(p) for _ in range(per_peer) for p in list(live)))
        while queue:
            await chunks.from_source(queue.popleft())
        path = await asyncio.to_thread(writer.finish)
    except BaseException:
        await asyncio.to_thread(writer.abort)
        raise
    report.seconds = time.perf_counter() - start
    return path, report
