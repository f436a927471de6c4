"""Peer-to-peer templates: workers serve the chunks of the templates they hold, and fetch
the templates they lack from peers, verified chunk by chunk, before reading the source.

Every worker has one :class:`TemplateStore` (``worker.extensions["dask-pcm-templates"]``). It
registers the comm handler ``pcm_template_chunk`` on the worker, which answers
``(digest, index)`` with that chunk read from disk, at most ``pcm.template.max-uploads`` at once
(the others wait their turn). :func:`fetch_coordinated` runs on a joining worker: in rounds it
asks the scheduler's chunk directory who holds each missing chunk of a
:class:`~dask_pcm.chunks.Manifest`, asks those peers (several chunks at once), verifies each
chunk against its SHA-256 and writes it into the worker's local copy through a
:class:`~dask_pcm.chunks.TemplateWriter`; what nobody holds comes from the source, read through
an optional :class:`~dask_pcm.throttle.SharedBandwidth` (the simulated shared filesystem).
Memory held at once is bounded by the chunks in flight, never the template's size.

Faults are bounded, never retried forever: every chunk request has a deadline
(``pcm.template.peer-connect-timeout`` plus the chunk at ``pcm.template.peer-min-bandwidth``),
after which its connection is aborted; a peer that fails once, or serves
:data:`MAX_BAD_CHUNKS` chunks that fail verification, is dropped for the copy (one warning per
peer) and the directory stops offering it for those chunks; the whole copy ends with a
:class:`~dask_pcm.TemplateFetchError` naming every peer and what it did after
``pcm.template.fetch-timeout``.
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
from dask_pcm.exceptions import TemplateFetchError

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
class PeerRecord:
    """What one peer did during one template copy."""

    chunks: int = 0
    nbytes: int = 0
    corrupted: int = 0
    dropped: str | None = None  # why it is no longer asked, for this copy

    def describe(self) -> str:
        text = f"served {self.chunks} chunk(s)"
        if self.corrupted:
            text += f", {self.corrupted} corrupted"
        return text + (f", dropped ({self.dropped})" if self.dropped else "")


@dataclass
class FetchReport:
    """Where the bytes of one template copy came from, and what each peer did."""

    bytes_from_peers: int = 0
    bytes_from_source: int = 0
    chunks_from_peers: int = 0
    chunks_from_source: int = 0
    corrupted: int = 0
    rounds: int = 0
    seconds: float = 0.0
    peers: dict[str, PeerRecord] = field(default_factory=dict)

    @property
    def failed_peers(self) -> list[str]:
        """Peers dropped during the copy (unreachable, too slow, or serving bad chunks)."""
        return [p for p, r in self.peers.items() if r.dropped]

    def describe_peers(self) -> str:
        if not self.peers:
            return "no peer held it"
        return "; ".join(f"{p} {r.describe()}" for p, r in self.peers.items())

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "peers"}
        out["failed_peers"] = self.failed_peers
        out["peers"] = {p: r.describe() for p, r in self.peers.items()}
        return out


# Outcomes of asking a peer for one chunk.
_OK, _CORRUPT, _FAILED = "ok", "corrupt", "failed"
# A peer that serves this many chunks that fail verification is dropped for the copy.
MAX_BAD_CHUNKS = 2
# Planning rounds in a row in which no chunk arrived before a copy gives up (every such
# round drops or strikes a peer, so only a pathological directory reaches it).
_MAX_FRUITLESS_ROUNDS = 20
# Longest pause between asking the directory again while others read what is missing.
_MAX_IDLE_WAIT = 1.0


class _PeerFailed(Exception):
    """A peer could not be reached, answered with an error, or not within its deadline."""


async def _ask_peer(worker: Worker, peer: str, digest: str, index: int, deadline: float) -> Any:
    """One chunk from ``peer``, within ``deadline`` seconds from connecting to the last byte.

    distributed retries a refused connection for ``distributed.comm.timeouts.connect``
    (30 s by default), and a request on an open connection has no timeout at all: a peer
    that was preempted, or is frozen (SIGSTOP, swapping), would stall the copy. On expiry
    the connection is aborted, never returned to the pool.
    """
    from distributed.core import send_recv

    comm = None

    async def ask() -> Any:
        nonlocal comm
        comm = await worker.rpc.connect(peer, timeout=config.peer_connect_timeout())
        return await send_recv(comm, op=HANDLER, digest=digest, index=index)

    try:
        data = await asyncio.wait_for(ask(), deadline)
    except asyncio.TimeoutError:
        if comm is not None:
            comm.abort()
        raise _PeerFailed(f"no answer within {deadline:.1f} s for chunk {index}") from None
    except BaseException as exc:
        if comm is not None:
            comm.abort()
        if isinstance(exc, Exception):
            raise _PeerFailed(f"{type(exc).__name__}: {exc}") from exc
        raise
    assert comm is not None
    worker.rpc.reuse(peer, comm)
    return data


class _Chunks:
    """Getting single chunks into a :class:`TemplateWriter`, from a peer or the source.

    Keeps the :class:`FetchReport`: a peer is dropped for this copy when it fails once
    (unreachable, erring, past its deadline) or serves :data:`MAX_BAD_CHUNKS` corrupted
    chunks, with one warning per dropped peer. Every attempt first checks the copy's
    deadline.
    """

    def __init__(
        self,
        worker: Worker,
        writer: TemplateWriter,
        report: FetchReport,
        source_root: str | Path | None,
        bandwidth: SharedBandwidth | None,
        timeout: float | None,
    ) -> None:
        self.worker = worker
        self.writer = writer
        self.manifest = writer.manifest
        self.report = report
        self.source_root = source_root
        self.bandwidth = bandwidth
        self.timeout = timeout
        self.start = time.perf_counter()

    def usable(self, peer: str) -> bool:
        record = self.report.peers.get(peer)
        return peer != self.worker.address and (record is None or record.dropped is None)

    def failure(self, reason: str) -> TemplateFetchError:
        """The error ending this copy: what is missing, why, and what every peer did."""
        missing = len(self.writer.missing)
        return TemplateFetchError(
            f"template {self.manifest.digest[:12]}... could not be assembled on "
            f"{self.worker.address} after {time.perf_counter() - self.start:.1f} s "
            f"({missing} of {self.manifest.nchunks} chunks missing): {reason}; "
            f"peers: {self.report.describe_peers()}"
        )

    def check_deadline(self) -> None:
        if self.timeout is not None and time.perf_counter() - self.start > self.timeout:
            raise self.failure(f"past pcm.template.fetch-timeout ({self.timeout:g} s)")

    def _drop(self, peer: str, why: str) -> None:
        record = self.report.peers[peer]
        if record.dropped is None:
            record.dropped = why
            logger.warning(
                "%s: dropped template peer %s for %s... (%s); %d chunk(s) came from it",
                self.worker.address,
                peer,
                self.manifest.digest[:12],
                why,
                record.chunks,
            )

    async def from_peer(self, peer: str, index: int) -> str:
        """Fetch, verify and write chunk ``index`` from ``peer``: ``_OK``, ``_CORRUPT``
        (discarded, the peer struck) or ``_FAILED`` (the peer dropped)."""
        self.check_deadline()
        record = self.report.peers.setdefault(peer, PeerRecord())
        deadline = config.peer_deadline(self.manifest.chunk(index).length)
        try:
            data = await _ask_peer(self.worker, peer, self.manifest.digest, index, deadline)
        except _PeerFailed as exc:
            self._drop(peer, str(exc))
            return _FAILED
        data = getattr(data, "data", data)  # in-process comms hand over the wrapper itself
        try:
            await asyncio.to_thread(self.writer.write, index, data)
        except ChunkError as exc:
            self.report.corrupted += 1
            record.corrupted += 1
            logger.debug("Discarded a corrupted chunk from %s: %s", peer, exc)
            if record.corrupted >= MAX_BAD_CHUNKS:
                self._drop(peer, f"{record.corrupted} corrupted chunks, the last: {exc}")
            return _CORRUPT
        record.chunks += 1
        record.nbytes += len(data)
        self.report.bytes_from_peers += len(data)
        self.report.chunks_from_peers += 1
        return _OK

    async def from_source(self, index: int) -> None:
        self.check_deadline()
        if self.source_root is None:
            raise self.failure(
                f"chunk {index} could not be had from any peer and no source was given"
            )
        if self.bandwidth is not None:
            await asyncio.to_thread(self.bandwidth.consume, self.manifest.chunk(index).length)
        data = await asyncio.to_thread(read_chunk, self.source_root, self.manifest, index)
        await asyncio.to_thread(self.writer.write, index, data)
        self.report.bytes_from_source += len(data)
        self.report.chunks_from_source += 1


async def _all(work: list[Any]) -> list[Any]:
    """Run ``work`` (coroutines) together; on the first error cancel the rest, then raise.

    Unlike ``asyncio.gather``, nothing keeps writing into a copy that is being aborted.
    """
    tasks = [asyncio.ensure_future(w) for w in work]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _timeout(timeout: float | str | None) -> float | None:
    return config.fetch_timeout() if timeout == "configured" else timeout  # type: ignore[return-value]


async def fetch_coordinated(
    worker: Worker,
    manifest: Manifest,
    dest: str | Path,
    source_root: str | Path | None,
    bandwidth: SharedBandwidth | None = None,
    in_flight: int = 4,
    timeout: float | str | None = "configured",
) -> tuple[Path, FetchReport]:
    """Assemble a template with the scheduler's chunk directory, sharing as chunks arrive.

    In rounds: ask the scheduler plugin for a plan (``pcm_chunk_plan``: peers for every
    missing chunk someone holds, partial copies included, and a source lease for at most a
    couple of chunks nobody holds or is reading), get those chunks (``in_flight`` at once),
    report each one held (``pcm_chunk_have``), and serve the chunks held so far to others.
    Workers that join together thus split the source between them and exchange the rest,
    instead of each reading the whole template from it.

    Bounded: every request has a deadline (:func:`dask_pcm.config.peer_deadline`); a peer
    that fails once or serves :data:`MAX_BAD_CHUNKS` corrupted chunks is dropped for this
    copy, and the directory stops offering it for the chunks it failed; what no usable peer
    holds comes from the source. The copy as a whole ends with :class:`TemplateFetchError`
    after ``timeout`` seconds (default ``pcm.template.fetch-timeout``) or
    ``_MAX_FRUITLESS_ROUNDS`` rounds in a row without a chunk.
    """
    report = FetchReport()
    writer = await asyncio.to_thread(TemplateWriter, manifest, dest)
    store = TemplateStore.of(worker)
    store.add_partial(writer)
    chunks = _Chunks(worker, writer, report, source_root, bandwidth, _timeout(timeout))
    gate = asyncio.Semaphore(in_flight)
    digest, me = manifest.digest, worker.address
    directory = worker.scheduler

    async def get(index: int, planned: list[str]) -> bool:
        """Chunk ``index`` from a planned peer, else (none usable) the source."""
        async with gate:
            tried = False
            for peer in planned:
                if not chunks.usable(peer):
                    continue
                tried = True
                outcome = await chunks.from_peer(peer, index)
                if outcome == _OK:
                    await directory.pcm_chunk_have(digest=digest, worker=me, indexes=[index])
                    return True
                # The directory stops offering this peer for this chunk (to anyone, when
                # it served bad bytes).
                await directory.pcm_chunk_have(
                    digest=digest,
                    worker=peer,
                    indexes=[],
                    lost=[index],
                    bad=[index] if outcome == _CORRUPT else [],
                )
            if tried:
                return False  # planned again next round, without what failed
            try:
                await chunks.from_source(index)
            finally:
                if not planned and index in writer.missing:  # give the lease back
                    await directory.pcm_chunk_have(
                        digest=digest, worker=me, indexes=[], released=[index]
                    )
            await directory.pcm_chunk_have(digest=digest, worker=me, indexes=[index])
            return True

    try:
        idle, fruitless = 0.05, 0
        while writer.missing:
            chunks.check_deadline()
            plan = await directory.pcm_chunk_plan(
                digest=digest, worker=me, missing=sorted(writer.missing)
            )
            report.rounds += 1
            work = [get(int(i), list(peers)) for i, peers in plan["peers"].items()]
            work += [get(int(i), []) for i in plan["source"]]
            if not work:  # every chunk left is being read by someone else
                await asyncio.sleep(idle)
                idle = min(2 * idle, _MAX_IDLE_WAIT)
                continue
            idle = 0.05
            if any(await _all(work)):
                fruitless = 0
            else:
                fruitless += 1
                if fruitless >= _MAX_FRUITLESS_ROUNDS:
                    raise chunks.failure(f"{fruitless} planning rounds in a row gave no chunk")
        path = await asyncio.to_thread(writer.finish)
        store.add(path, manifest)
    except BaseException:
        store.partial.pop(digest, None)
        held = sorted(set(range(manifest.nchunks)) - writer.missing)
        await asyncio.to_thread(writer.abort)
        with contextlib.suppress(Exception):
            await directory.pcm_chunk_have(digest=digest, worker=me, indexes=[], lost=held)
        raise
    report.seconds = time.perf_counter() - chunks.start
    return path, report


async def fetch_template(
    worker: Worker,
    manifest: Manifest,
    dest: str | Path,
    peers: list[str],
    source_root: str | Path | None,
    bandwidth: SharedBandwidth | None = None,
    per_peer: int = 2,
    timeout: float | str | None = "configured",
) -> tuple[Path, FetchReport]:
    """Assemble ``manifest``'s template at ``dest`` from ``peers``, else from the source.

    Without the scheduler's chunk directory (``pcm.template.peer-to-peer`` false: ``peers``
    is empty and everything comes from the source). Each peer gets at most ``per_peer``
    requests at once; the chunks a peer fails or corrupts go back in the queue for the
    others (or the source), under the same bounds as :func:`fetch_coordinated`. Raises
    :class:`TemplateFetchError` when a chunk cannot be had from anywhere.
    """
    report = FetchReport()
    writer = await asyncio.to_thread(TemplateWriter, manifest, dest)
    chunks = _Chunks(worker, writer, report, source_root, bandwidth, _timeout(timeout))
    queue: deque[int] = deque(range(manifest.nchunks))
    live = [p for p in dict.fromkeys(peers) if chunks.usable(p)]

    async def from_peer(peer: str) -> None:
        while queue and chunks.usable(peer):
            index = queue.popleft()
            if await chunks.from_peer(peer, index) != _OK:
                queue.append(index)  # to another peer, or the source

    try:
        await _all([from_peer(p) for _ in range(per_peer) for p in live])
        while queue:
            await chunks.from_source(queue.popleft())
        path = await asyncio.to_thread(writer.finish)
    except BaseException:
        await asyncio.to_thread(writer.abort)
        raise
    report.seconds = time.perf_counter() - chunks.start
    return path, report
