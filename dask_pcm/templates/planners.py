"""Where a template copy's chunks come from: the planners :func:`dask_pcm.templates.fetch.fetch`
asks, and the reports it sends them.

:class:`DirectoryPlanner` asks the scheduler's chunk directory
(:mod:`dask_pcm.scheduler.directory`); :class:`SourcePlanner` plans every chunk from the source
(``pcm.template.peer-to-peer: false``). :class:`Reports` sends what a copy tells its planner in
order, in the background.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Protocol

from dask_pcm.protocol import CHUNK_HAVE_OP, CHUNK_PLAN_OP

if TYPE_CHECKING:
    from distributed import Worker


class Planner(Protocol):
    """Where the missing chunks of one copy should come from now, and who holds what."""

    async def plan(self, missing: list[int], limit: int, wait: float = 0.0) -> dict[str, Any]:
        """``{"peers": {index: [workers]}, "source": [indexes]}``: at most ``limit`` of the
        ``missing`` chunks to fetch now, each from the first usable of its peers, or (no
        peers) from the source. With nothing to plan now, it may wait up to ``wait`` seconds
        for something. ``"together": True`` when other workers copy the template too (the
        copy then keeps its window small: :meth:`~dask_pcm.templates.window.Window.shared`)."""
        ...

    async def have(self, worker: str, indexes: list[int], **changes: list[int]) -> None:
        """``worker`` holds ``indexes`` now (and ``released``, ``lost``, ``bad``)."""
        ...


class DirectoryPlanner:
    """Plans from the scheduler's chunk directory (peer to peer)."""

    def __init__(self, worker: Worker, digest: str) -> None:
        self.worker = worker
        self.digest = digest

    async def plan(self, missing: list[int], limit: int, wait: float = 0.0) -> dict[str, Any]:
        rpc = getattr(self.worker.scheduler, CHUNK_PLAN_OP)
        return await rpc(
            digest=self.digest,
            worker=self.worker.address,
            missing=missing,
            limit=limit,
            wait=wait,
        )

    async def have(self, worker: str, indexes: list[int], **changes: list[int]) -> None:
        rpc = getattr(self.worker.scheduler, CHUNK_HAVE_OP)
        await rpc(digest=self.digest, worker=worker, indexes=indexes, **changes)


class SourcePlanner:
    """Every chunk from the source (``pcm.template.peer-to-peer: false``)."""

    async def plan(self, missing: list[int], limit: int, wait: float = 0.0) -> dict[str, Any]:
        return {"peers": {}, "source": list(missing[:limit])}

    async def have(self, worker: str, indexes: list[int], **changes: list[int]) -> None:
        pass


class Reports:
    """What a copy tells its planner (chunks held, released, lost, bad), sent in order in the
    background: a chunk's slot is free for the next as soon as the chunk is written, not a
    scheduler round trip later (a round trip that, on a busy link, waits behind the chunks
    queued on it). :meth:`check` raises what a failed report raised."""

    def __init__(self, planner: Planner) -> None:
        self.planner = planner
        self.last: asyncio.Future[None] | None = None

    def put(self, worker: str, indexes: list[int], **changes: list[int]) -> None:
        self.last = asyncio.ensure_future(self._after(self.last, worker, indexes, changes))

    async def _after(
        self,
        previous: asyncio.Future[None] | None,
        worker: str,
        indexes: list[int],
        changes: dict[str, list[int]],
    ) -> None:
        if previous is not None:
            await previous  # in order; after a failed one, none
        await self.planner.have(worker, indexes, **changes)

    def check(self) -> None:
        if self.last is not None and self.last.done():
            self.last.result()

    async def flush(self) -> None:
        if self.last is not None:
            await self.last

    async def cancel(self) -> None:
        if self.last is not None:
            self.last.cancel()
            await asyncio.gather(self.last, return_exceptions=True)
