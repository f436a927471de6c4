"""Copying a template to a worker's disk: chunk by chunk, from peers or the source.

:func:`fetch` assembles a template (its :class:`~dask_pcm.templates.manifest.Manifest`) in a
:class:`~dask_pcm.templates.manifest.TemplateWriter`, a few chunks at a time: whenever a
slot is free, a *planner* says which missing chunks to fetch now and where from; each is
fetched, verified against its SHA-256 and written, and the planner is told.
:class:`DirectoryPlanner` asks the scheduler's chunk directory
(:mod:`dask_pcm.scheduler.directory`): the rarest chunks first, each from the least busy peer
holding it (whole copies and partial ones), and a source lease for chunks nobody holds, a
few at a time across the cluster; with nothing to plan it holds the answer until something
changes, so a chunk is passed on as soon as a peer has it. Workers that join together thus
read the source once between them and pass each chunk on while the next is read, and the
copy serves what it already holds (:mod:`dask_pcm.templates.serve`).
:class:`SourcePlanner` (``pcm.template.peer-to-peer: false``) plans every chunk from the
source. Source reads go through a :class:`~dask_pcm.templates.reader.SourceReader` (which
tests and benchmarks replace with a throttled one). Memory held at once is bounded by the
chunks in flight, never the template's size. :mod:`dask_pcm.testing.broadcast` runs this
code for hundreds of simulated workers.

Faults are bounded, never retried forever: every chunk request has a deadline
(:func:`dask_pcm.config.peer_deadline`), after which its connection is aborted; a peer that
fails once, or serves :data:`MAX_BAD_CHUNKS` chunks that fail verification, is dropped for the
copy (one warning per peer) and the directory stops offering it for those chunks; what no
usable peer holds comes from the source; the whole copy ends with a
:class:`~dask_pcm.TemplateFetchError` naming every peer and what it did after
``pcm.template.fetch-timeout``, or after ``_MAX_FRUITLESS`` chunk requests in a row that
brought nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distributed.core import send_recv

from dask_pcm import config
from dask_pcm.exceptions import ChunkError, TemplateFetchError
from dask_pcm.protocol import CHUNK_OP
from dask_pcm.templates.manifest import Manifest, TemplateWriter
from dask_pcm.templates.planners import DirectoryPlanner, Planner, Reports, SourcePlanner
from dask_pcm.templates.reader import SourceReader, source_reader
from dask_pcm.templates.report import FetchReport, PeerRecord
from dask_pcm.templates.serve import TemplateStore
from dask_pcm.templates.window import Window

if TYPE_CHECKING:
    from distributed import Worker

__all__ = ["MAX_BAD_CHUNKS", "DirectoryPlanner", "Planner", "SourcePlanner", "fetch"]

logger = logging.getLogger(__name__)


# Outcomes of asking a peer for one chunk.
_OK, _CORRUPT, _FAILED = "ok", "corrupt", "failed"
# A peer that serves this many chunks that fail verification is dropped for the copy.
MAX_BAD_CHUNKS = 2
# Chunk requests in a row that brought nothing before a copy gives up (every such request
# drops or strikes a peer, so only a pathological directory reaches it).
_MAX_FRUITLESS = 20
# Pauses between asking the directory again while others read what is missing.
_FIRST_IDLE_WAIT = 0.05
_MAX_IDLE_WAIT = 1.0
# How long a copy with no chunk in flight lets the planner wait for one to plan.
_PLAN_WAIT = 2.0
# Chunks arrived and still being verified and written, beyond the window: the next chunks
# are received while earlier ones are hashed and written (on another core), not after.
WRITE_AHEAD = 2


# Called with a chunk's index and its size once its bytes are in (0: the request failed).
_Arrived = Callable[[int, int], None]


class _PeerFailed(Exception):
    """A peer could not be reached, answered with an error, or not within its deadline."""


async def _ask_peer(worker: Worker, peer: str, digest: str, index: int, deadline: float) -> Any:
    """One chunk from ``peer``, within ``deadline`` seconds from connecting to the last byte.

    distributed retries a refused connection for ``distributed.comm.timeouts.connect``
    (30 s by default), and a request on an open connection has no timeout at all: a peer
    that was preempted, or is frozen (SIGSTOP, swapping), would stall the copy. On expiry
    the connection is aborted, never returned to the pool.
    """
    comm = None

    async def ask() -> Any:
        nonlocal comm
        comm = await worker.rpc.connect(peer, timeout=config.peer_connect_timeout())
        return await send_recv(comm, op=CHUNK_OP, digest=digest, index=index)

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
        reader: SourceReader,
        timeout: float | None,
    ) -> None:
        self.worker = worker
        self.writer = writer
        self.manifest = writer.manifest
        self.report = report
        self.source_root = source_root
        self.reader = reader
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

    async def from_peer(self, peer: str, index: int, arrived: _Arrived) -> str:
        """Fetch, verify and write chunk ``index`` from ``peer``: ``_OK``, ``_CORRUPT``
        (discarded, the peer struck) or ``_FAILED`` (the peer dropped). ``arrived`` is
        called once the bytes are in (or the request failed), before they are verified."""
        self.check_deadline()
        record = self.report.peers.setdefault(peer, PeerRecord())
        deadline = config.peer_deadline(self.manifest.chunk(index).length)
        asked = time.time()
        try:
            data = await _ask_peer(self.worker, peer, self.manifest.digest, index, deadline)
        except _PeerFailed as exc:
            arrived(index, 0)
            self._drop(peer, str(exc))
            return _FAILED
        # A uint8 array over the buffer the comm read into (bytes from older peers); in-process
        # comms hand over the wrapper itself.
        data = memoryview(getattr(data, "data", data))
        self.report.timeline.append((index, peer, asked, time.time()))
        arrived(index, len(data))
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
        self.report.bytes_from_peers += len(data)
        self.report.chunks_from_peers += 1
        return _OK

    async def from_source(self, index: int, arrived: _Arrived) -> None:
        self.check_deadline()
        if self.source_root is None:
            raise self.failure(
                f"chunk {index} could not be had from any peer and no source was given"
            )
        asked = time.time()
        try:
            data = await self.reader.aread(self.source_root, self.manifest, index)
        except BaseException:
            arrived(index, 0)
            raise
        self.report.timeline.append((index, "", asked, time.time()))
        arrived(index, len(data))
        await asyncio.to_thread(self.writer.write, index, data)
        self.report.bytes_from_source += len(data)
        self.report.chunks_from_source += 1


def _timeout(timeout: float | str | None) -> float | None:
    return config.fetch_timeout() if timeout == "configured" else timeout  # type: ignore[return-value]


async def fetch(
    worker: Worker,
    manifest: Manifest,
    dest: str | Path,
    source_root: str | Path | None,
    planner: Planner | None = None,
    reader: SourceReader | None = None,
    in_flight: int | None = None,
    timeout: float | str | None = "configured",
    report: FetchReport | None = None,
    max_in_flight: int | None = None,
) -> tuple[Path, FetchReport]:
    """Assemble ``manifest``'s template at ``dest`` on ``worker``; the path and a report.

    Runs on the worker's event loop. ``planner`` defaults to :class:`DirectoryPlanner` (or
    :class:`SourcePlanner` with ``pcm.template.peer-to-peer`` false), ``reader`` to
    :func:`~dask_pcm.templates.reader.source_reader`, ``timeout`` to
    ``pcm.template.fetch-timeout``. Chunks are received ``in_flight`` at a time at first
    (``pcm.template.in-flight``), then as many as the rate they arrive at says
    (:class:`~dask_pcm.templates.window.Window`), never more than ``max_in_flight``
    (``pcm.template.max-in-flight``); each is verified and written while the next ones
    arrive, at most :data:`WRITE_AHEAD` beyond the window, so the copy holds at most
    ``max_in_flight + WRITE_AHEAD`` chunks in memory.
    ``source_root`` is the folder the manifest's files are relative to (None: peers only).
    ``report``, when given, is filled as chunks arrive (for progress), and returned.

    Raises
    ------
    TemplateFetchError
        A chunk could be had from nowhere, or the copy ran past its bounds.
    """
    if planner is None:
        peer_to_peer = config.get("template.peer-to-peer")
        planner = DirectoryPlanner(worker, manifest.digest) if peer_to_peer else SourcePlanner()
    reader = reader or source_reader()
    in_flight = in_flight or int(config.get("template.in-flight"))
    cap = max_in_flight or int(config.get("template.max-in-flight"))
    window = Window(in_flight, cap)
    report = FetchReport() if report is None else report
    writer = await asyncio.to_thread(TemplateWriter, manifest, dest)
    store = TemplateStore.of(worker)
    store.add_partial(writer)  # serve what arrives, at once
    chunks = _Chunks(worker, writer, report, source_root, reader, _timeout(timeout))
    me = worker.address
    reports = Reports(planner)
    loop = asyncio.get_running_loop()
    receiving: set[int] = set()  # chunks requested whose bytes are not in yet
    wake = asyncio.Event()  # a chunk's bytes are in: its slot in the window is free

    def arrived(index: int, nbytes: int) -> None:
        receiving.discard(index)
        if nbytes:
            window.received(nbytes, loop.time())
        wake.set()

    async def get(index: int, planned: list[str]) -> bool:
        """Chunk ``index`` from a planned peer, else (none usable) the source."""
        tried = False
        for peer in planned:
            if not chunks.usable(peer):
                continue
            tried = True
            receiving.add(index)
            outcome = await chunks.from_peer(peer, index, arrived)
            if outcome == _OK:
                reports.put(me, [index])
                return True
            # The directory stops offering this peer for this chunk (to anyone, when it
            # served bad bytes).
            bad = [index] if outcome == _CORRUPT else []
            reports.put(peer, [], lost=[index], bad=bad)
        if tried:
            reports.put(me, [], released=[index])
            return False  # planned again, without what failed
        try:
            receiving.add(index)
            await chunks.from_source(index, arrived)
        finally:
            receiving.discard(index)
            if not planned and index in writer.missing:  # give the lease back
                reports.put(me, [], released=[index])
        reports.put(me, [index])
        return True

    running: dict[int, asyncio.Task[bool]] = {}
    try:
        idle, fruitless = _FIRST_IDLE_WAIT, 0
        while writer.missing:
            chunks.check_deadline()
            reports.check()
            # Room in the window (chunks being received) and in memory (chunks held).
            free = max(
                0, min(window.size - len(receiving), window.size + WRITE_AHEAD - len(running))
            )
            wanted = sorted(writer.missing - running.keys())
            started = 0
            if free and wanted:
                # With nothing in flight, the planner may hold the answer until it has one.
                plan = await planner.plan(wanted, free, 0.0 if running else _PLAN_WAIT)
                report.rounds += 1
                work = [(int(i), list(peers)) for i, peers in plan["peers"].items()]
                work += [(int(i), []) for i in plan["source"]]
                if work:
                    window.started(loop.time())
                for index, peers in work:
                    receiving.add(index)  # counted in the window from now
                    running[index] = asyncio.ensure_future(get(index, peers))
                started = len(work)
                if plan.get("together"):
                    window.shared(loop.time())
                elif started < free:
                    window.starved(loop.time())
            if not running:  # every chunk left is being read by someone else
                await asyncio.sleep(idle)
                idle = min(2 * idle, _MAX_IDLE_WAIT)
                continue
            # Until a chunk is in (or written); while slots are free, ask again after a pause.
            wake.clear()
            woken = asyncio.ensure_future(wake.wait())
            try:
                done, _ = await asyncio.wait(
                    [*running.values(), woken],
                    timeout=idle if started < free else None,
                    return_when=asyncio.FIRST_COMPLETED,
                )
            finally:
                woken.cancel()
            done.discard(woken)
            idle = _FIRST_IDLE_WAIT if done or wake.is_set() else min(2 * idle, _MAX_IDLE_WAIT)
            for index in [i for i, task in running.items() if task in done]:
                if running.pop(index).result():
                    fruitless = 0
                else:
                    fruitless += 1
            if fruitless >= _MAX_FRUITLESS:
                raise chunks.failure(f"{fruitless} chunk requests in a row brought nothing")
        await asyncio.gather(*running.values())
        running.clear()
        await reports.flush()  # the last reports reach the planner
        path = await asyncio.to_thread(writer.finish)
        store.add(path, manifest)
        store.reports[manifest.digest] = report
    except BaseException:
        # Nothing keeps writing into a copy that is being given up.
        for task in running.values():
            task.cancel()
        await asyncio.gather(*running.values(), return_exceptions=True)
        await reports.cancel()
        store.partial.pop(manifest.digest, None)
        held = sorted(set(range(manifest.nchunks)) - writer.missing)
        await asyncio.to_thread(writer.abort)
        with contextlib.suppress(Exception):
            await planner.have(me, [], lost=held, released=sorted(writer.missing))
        raise
    report.window = window.size
    report.peak_window = window.peak
    report.seconds = time.perf_counter() - chunks.start
    return path, report
