"""A template broadcast to hundreds of workers, simulated on one event loop in virtual time.

What runs is the real code: every simulated worker copies the template with
:func:`dask_pcm.templates.fetch.fetch`, plans with
:class:`~dask_pcm.templates.fetch.DirectoryPlanner` against one real
:class:`~dask_pcm.scheduler.directory.ChunkDirectory`, and serves its chunks (whole or
partial copy) with the real :class:`~dask_pcm.templates.serve.TemplateStore` handler, through
distributed's ``send_recv``. What is simulated is the network and the clock:

- a :class:`Network` of links, each with a capacity in bytes per second: one upload and one
  download link per worker, and one for the source (a shared filesystem). Flows share every
  link they cross equally (a flow's rate is the smallest share along its path), as TCP
  streams roughly do; every message pays the one-way ``latency``. A source read is such a
  flow, over the reader's download link, or (``source_model="queued"``) a turn at the
  source off the links, as ``pcm.template.source-bandwidth`` serves reads;
- a :class:`VirtualClockLoop`: an asyncio event loop whose clock jumps to the next timer
  whenever nothing is ready to run, so a broadcast of gigabytes to hundreds of workers takes
  the real time of its work, not of its waits. Work handed to threads (disk writes, hashing)
  is waited for with the clock stopped: disk and CPU cost no simulated time, the network all
  of it. The scheduler's own time is the exception: every directory call is charged the
  CPU time it took, one call at a time, as on the scheduler's single event loop.

The template's bytes are synthetic and ``scale`` times smaller than the sizes simulated (a
3.4 GB template is 13 KB on disk at the default scale): chunks are real files, verified
against their SHA-256 as always, and each byte stands for ``scale`` bytes on the links.

Example
-------
>>> result = simulate(64, "p2p", template_bytes=3.4e9, link=1e9, source=1e9)  # doctest: +SKIP
>>> result["seconds"], result["source_bytes"] / 3.4e9                          # doctest: +SKIP
(4.1, 1.0)
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hashlib
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dask.config
import dask.utils
from distributed.protocol.serialize import Serialize

from dask_pcm.protocol import CHUNK_HAVE_OP, CHUNK_PLAN_OP
from dask_pcm.scheduler.directory import ChunkDirectory
from dask_pcm.templates.fetch import DirectoryPlanner, SourcePlanner, fetch
from dask_pcm.templates.manifest import FileEntry, Manifest, _digest, read_chunk
from dask_pcm.templates.reader import SourceReader
from dask_pcm.templates.report import FetchReport
from dask_pcm.templates.serve import TemplateStore
from dask_pcm.testing.netsim import Network, VirtualClockLoop

__all__ = [
    "MODES",
    "SOURCE_MODELS",
    "Network",
    "VirtualClockLoop",
    "simulate",
    "synthetic_template",
]

MODES = ("source", "p2p")
SOURCE_MODELS = ("shared", "queued")


# -- simulated workers, comms and scheduler ---------------------------------------------------
class _Comm:
    """A connection to a simulated peer: a request, then its answer over the links."""

    deserialize = True

    def __init__(self, sim: _Simulation, me: str, peer: str) -> None:
        self.sim, self.me, self.peer = sim, me, peer
        self.request: dict[str, Any] = {}
        self._closed = False

    async def write(self, msg: dict[str, Any], **_: Any) -> int:
        self.request = dict(msg)
        return 0

    async def read(self, **_: Any) -> Any:
        msg = self.request
        handler = self.sim.workers[self.peer].handlers[msg.pop("op")]
        msg.pop("reply", None)
        asked = asyncio.get_running_loop().time()
        with self.sim.receiving(self.me):
            await asyncio.sleep(self.sim.network.latency)  # the request
            answer = await handler(**msg)
            data = answer.data if isinstance(answer, Serialize) else answer
            nbytes = len(data) * self.sim.scale
            self.sim.uploads[self.peer] = self.sim.uploads.get(self.peer, 0.0) + nbytes
            await self.sim.network.transfer((f"{self.peer}/up", f"{self.me}/down"), nbytes)
        self.sim.arrived(self.me, msg["index"], self.peer, asked)
        return answer

    def abort(self) -> None:
        self._closed = True

    async def close(self) -> None:
        self._closed = True

    def closed(self) -> bool:
        return self._closed


class _PeerRPC:
    """``worker.rpc``: connections to peers, pooled."""

    def __init__(self, sim: _Simulation, me: str) -> None:
        self.sim, self.me = sim, me
        self.pool: dict[str, list[_Comm]] = {}

    async def connect(self, peer: str, timeout: float | None = None) -> _Comm:
        idle = self.pool.get(peer)
        if idle:
            return idle.pop()
        await asyncio.sleep(2 * self.sim.network.latency)  # a handshake
        return _Comm(self.sim, self.me, peer)

    def reuse(self, peer: str, comm: _Comm) -> None:
        if not comm.closed():
            self.pool.setdefault(peer, []).append(comm)


class _SchedulerRPC:
    """``worker.scheduler``: the chunk directory's handlers, over the network."""

    def __init__(self, sim: _Simulation) -> None:
        self.sim = sim

    def __getattr__(self, op: str) -> Any:
        return lambda **kwargs: self.sim.call_scheduler(op, kwargs)


class _Worker:
    """What :func:`fetch` and :class:`TemplateStore` use of a ``distributed.Worker``."""

    def __init__(self, sim: _Simulation, address: str, max_uploads: int) -> None:
        self.address = address
        self.handlers: dict[str, Any] = {}
        self.extensions: dict[str, Any] = {}
        self.rpc = _PeerRPC(sim, address)
        self.scheduler = _SchedulerRPC(sim)
        self.extensions["dask-pcm-templates"] = TemplateStore(self, max_uploads)  # type: ignore[arg-type]


class _SimReader(SourceReader):
    """Source reads as the simulation's ``source_model`` has them (:func:`simulate`)."""

    def __init__(self, sim: _Simulation, me: str) -> None:
        self.sim, self.me = sim, me

    async def aread(self, root: str | os.PathLike[str], manifest: Manifest, index: int) -> bytes:
        data = read_chunk(root, manifest, index)
        nbytes = len(data) * self.sim.scale
        loop = asyncio.get_running_loop()
        asked = loop.time()
        with self.sim.receiving(self.me):
            if self.sim.source_model == "shared":
                await self.sim.network.transfer(("source", f"{self.me}/down"), nbytes)
            else:
                # Booked as pcm.template.source-bandwidth books a read: after those before it.
                start = max(loop.time(), self.sim.source_free_at)
                self.sim.source_free_at = start + nbytes / self.sim.network.capacity["source"]
                moved = self.sim.network.moved
                moved["source"] = moved.get("source", 0.0) + nbytes
                await asyncio.sleep(self.sim.source_free_at - loop.time())
        self.sim.arrived(self.me, index, "", asked)
        return data


# Real seconds the directory spent on the scheduler call being answered.
_CHARGE: contextvars.ContextVar[list[float]] = contextvars.ContextVar("charge")


@dataclass
class _Simulation:
    network: Network
    scale: int
    source_model: str = "shared"
    source_free_at: float = 0.0  # "queued": when the source has served every read booked
    workers: dict[str, _Worker] = field(default_factory=dict)
    directory: ChunkDirectory | None = None
    uploads: dict[str, float] = field(default_factory=dict)
    scheduler_seconds: float = 0.0
    # Chunks each worker is receiving now, and the most at once.
    in_flight: dict[str, int] = field(default_factory=dict)
    peak_in_flight: dict[str, int] = field(default_factory=dict)
    # Each worker's chunks as FetchReport.timeline has them, in simulated seconds:
    # (index, peer or "" for the source, asked, last byte in).
    timelines: dict[str, list[tuple[int, str, float, float]]] = field(default_factory=dict)
    _busy_until: float = 0.0

    def arrived(self, worker: str, index: int, peer: str, asked: float) -> None:
        """``worker`` has chunk ``index``'s bytes, asked for at ``asked``, from ``peer``."""
        now = asyncio.get_running_loop().time()
        self.timelines.setdefault(worker, []).append((index, peer, asked, now))

    @contextlib.contextmanager
    def receiving(self, worker: str) -> Iterator[None]:
        """``worker`` receives a chunk meanwhile (counted for :attr:`peak_in_flight`)."""
        now = self.in_flight[worker] = self.in_flight.get(worker, 0) + 1
        self.peak_in_flight[worker] = max(self.peak_in_flight.get(worker, 0), now)
        try:
            yield
        finally:
            self.in_flight[worker] -= 1

    def attach(self, directory: ChunkDirectory) -> None:
        """Use ``directory``, timing each of its plans and reports."""
        for name in ("plan", "have"):
            setattr(directory, name, self._timed(getattr(directory, name)))
        self.directory = directory

    def _timed(self, method: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            # CPU time of this thread, not the wall clock: on a busy machine a call that is
            # descheduled midway must not make the simulated scheduler slower.
            start = time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                spent = time.thread_time() - start
                self.scheduler_seconds += spent
                charge = _CHARGE.get(None)
                if charge is not None:
                    charge[0] += spent

        return timed

    async def call_scheduler(self, op: str, kwargs: dict[str, Any]) -> Any:
        """A worker's call of the scheduler's handler ``op``: a message each way, and the
        handler's time, the scheduler doing one thing at a time."""
        assert self.directory is not None
        handlers: dict[str, Callable[..., Any]] = {
            CHUNK_PLAN_OP: self.directory.plan_waiting,
            CHUNK_HAVE_OP: self.directory.have,
        }
        handler = handlers[op]
        loop = asyncio.get_running_loop()
        await asyncio.sleep(self.network.latency)
        charge = [0.0]
        token = _CHARGE.set(charge)
        try:
            answer = handler(**kwargs)
            if asyncio.iscoroutine(answer):
                answer = await answer
        finally:
            _CHARGE.reset(token)
        self._busy_until = max(loop.time(), self._busy_until) + charge[0]
        await asyncio.sleep(self._busy_until - loop.time() + self.network.latency)
        return answer


def synthetic_template(
    folder: str | os.PathLike[str],
    template_bytes: float | Sequence[float],
    chunk_size: int,
    scale: int,
) -> tuple[Manifest, Path]:
    """A template of ``template_bytes / scale`` bytes in chunks of ``chunk_size / scale``
    and its manifest: one ``model.safetensors`` of pseudo-random bytes, or, given a size per
    file (a real template's), one file of each size, each cut into chunks of its own as a
    manifest cuts a folder (a file smaller than a chunk is a chunk alone)."""
    if chunk_size % scale:
        raise ValueError(f"chunk size {chunk_size} is not a multiple of scale {scale}")
    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    sizes = [template_bytes] if isinstance(template_bytes, (int, float)) else list(template_bytes)
    if not sizes or min(sizes) <= 0:
        raise ValueError(f"every file needs a size above 0, got {sizes}")
    piece = chunk_size // scale
    files = []
    for k, total in enumerate(sizes):
        size = math.ceil(total / scale)
        seed = k << 32
        data = b"".join(
            hashlib.sha256((seed + i).to_bytes(8, "little")).digest()
            for i in range(math.ceil(size / 32))
        )[:size]
        name = "model.safetensors" if len(sizes) == 1 else f"file-{k:03d}.bin"
        (root / name).write_bytes(data)
        chunks = tuple(
            hashlib.sha256(data[i : i + piece]).hexdigest() for i in range(0, size, piece)
        )
        files.append(FileEntry(name, size, chunks))
    return Manifest(piece, tuple(files), _digest(piece, tuple(files))), root


async def _broadcast(
    n: int,
    mode: str,
    folder: Path,
    template_bytes: float | Sequence[float],
    chunk_size: int,
    link: float,
    source: float,
    latency: float,
    scale: int,
    in_flight: int,
    max_uploads: int,
    max_in_flight: int | None,
    source_model: str,
) -> dict[str, Any]:
    manifest, root = synthetic_template(folder / "source", template_bytes, chunk_size, scale)
    names = [f"sim://worker-{i}" for i in range(n)]
    capacity = {"source": float(source)}
    for name in names:
        capacity[f"{name}/up"] = capacity[f"{name}/down"] = float(link)
    sim = _Simulation(Network(capacity, latency), scale, source_model)
    sim.workers = {name: _Worker(sim, name, max_uploads) for name in names}
    held: dict[str, float] = {}  # worker -> when it held the whole template
    sim.attach(
        ChunkDirectory(
            whole_copies=lambda digest: held.keys(),  # a view: no copy per plan
            connected=lambda: sim.workers.keys(),
            max_uploads=max_uploads,
        )
    )

    windows: dict[str, int] = {}  # worker -> the most chunks it had in flight

    async def copy(i: int, name: str) -> None:
        worker = sim.workers[name]
        report = FetchReport()
        planner = (
            DirectoryPlanner(worker, manifest.digest) if mode == "p2p" else SourcePlanner()  # type: ignore[arg-type]
        )
        await fetch(
            worker,  # type: ignore[arg-type]
            manifest,
            folder / f"worker-{i}" / "copy",
            root,
            planner=planner,
            reader=_SimReader(sim, name),
            in_flight=in_flight,
            timeout=None,
            max_in_flight=max_in_flight,
            report=report,
        )
        windows[name] = report.peak_window
        held[name] = asyncio.get_running_loop().time()

    real = time.perf_counter()
    await asyncio.gather(*(copy(i, name) for i, name in enumerate(names)))
    times = sorted(held.values())
    uploads = [sim.uploads.get(name, 0.0) for name in names]
    return {
        "n": n,
        "mode": mode,
        "seconds": times[-1],
        "median_seconds": times[len(times) // 2],
        "first_seconds": times[0],
        "source_bytes": sim.network.moved.get("source", 0.0),
        "peer_bytes": sum(uploads),
        "max_peer_upload_bytes": max(uploads),
        "template_bytes": manifest.total_bytes * scale,
        "chunks": manifest.nchunks,
        "chunk_bytes": [manifest.chunk(i).length * scale for i in range(manifest.nchunks)],
        "scheduler_seconds": sim.scheduler_seconds,
        "peak_windows": [windows[name] for name in names],
        "peak_in_flight": max(sim.peak_in_flight.values(), default=0),
        "timelines": sim.timelines,
        "real_seconds": time.perf_counter() - real,
    }


def simulate(
    n: int,
    mode: str = "p2p",
    *,
    template_bytes: float | Sequence[float] = 3.4e9,
    chunk_size: int = 64 << 20,
    link: float = 1e9,
    source: float = 1e9,
    latency: float = 0.0002,
    scale: int = 1 << 18,
    in_flight: int | None = None,
    max_uploads: int | None = None,
    max_in_flight: int | None = None,
    source_model: str = "shared",
) -> dict[str, Any]:
    """``n`` workers that join at once copy a template; when the last holds it, and traffic.

    ``mode`` ``"p2p"`` plans from the chunk directory, ``"source"`` reads everything from
    the source. ``template_bytes`` is the template's size, as one file, or each file's
    size (a real template's: ``[f.size for f in manifest.files]``), each file then cut into
    chunks of its own as a manifest cuts a folder. ``link`` is each worker's upload and download capacity, ``source`` the
    source's, both in bytes per second; ``latency`` is one way, in seconds.
    ``source_model`` says how the source serves reads at once: ``"shared"`` (its capacity
    shared equally between them, each read crossing its reader's download link, as a
    shared filesystem reached over the workers' network) or ``"queued"`` (one after
    another in the order asked, off the workers' links, as ``pcm.template.source-bandwidth``
    books them: the source of ``benchmarks/scale_out.py --hosts``).

    Returns a dict: ``seconds`` (simulated, until the last worker holds the whole template;
    also ``median_seconds`` and ``first_seconds``), ``source_bytes``, ``peer_bytes``,
    ``max_peer_upload_bytes`` (the busiest uploader), ``scheduler_seconds`` (CPU time in
    the directory), ``peak_windows`` (each worker's largest window),
    ``peak_in_flight`` (the most chunks any worker was receiving at once),
    ``chunk_bytes`` (each chunk's size), ``timelines`` (each worker's chunks, as :attr:`FetchReport.timeline
    <dask_pcm.templates.report.FetchReport.timeline>` keeps them, in simulated seconds) and
    ``real_seconds`` (what the simulation took). ``in_flight``, ``max_in_flight`` and
    ``max_uploads`` default to their ``pcm.template`` settings.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    if source_model not in SOURCE_MODELS:
        raise ValueError(f"source_model must be one of {SOURCE_MODELS}, got {source_model!r}")
    in_flight = in_flight or int(dask.config.get("pcm.template.in-flight"))
    max_uploads = max_uploads or int(dask.config.get("pcm.template.max-uploads"))
    loop = VirtualClockLoop()
    # A peer's deadline for a chunk is reckoned from its size on disk, ``scale`` times smaller
    # than the size simulated: the slowest rate allowed shrinks with it.
    slowest = dask.utils.parse_bytes(
        str(dask.config.get("pcm.template.peer-min-bandwidth")).removesuffix("/s")
    )
    try:
        with (
            dask.config.set({"pcm.template.peer-min-bandwidth": max(1, slowest // scale)}),
            tempfile.TemporaryDirectory(prefix="pcm-broadcast-") as folder,
        ):
            return loop.run_until_complete(
                _broadcast(
                    n,
                    mode,
                    Path(folder),
                    template_bytes,
                    chunk_size,
                    link,
                    source,
                    latency,
                    scale,
                    in_flight,
                    max_uploads,
                    max_in_flight,
                    source_model,
                )
            )
    finally:
        loop.shut()
