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

    #: Seconds a call to the planner takes, recent calls weighed most (None: no calls
    #: timed yet, or a planner that makes none).
    round_trip: float | None

    async def plan(
        self, missing: list[int], limit: int, wait: float = 0.0, extra: int = 0
    ) -> dict[str, Any]:
        """``{"peers": {index: [workers]}, "source": [indexes]}``: at most ``limit`` of the
        ``missing`` chunks to fetch now, each from the first usable of its peers, or (no
        peers) from the source. With nothing to plan now, it may wait up to ``wait`` seconds
        for something. ``"together": True`` when other workers copy the template too (the
        copy then keeps its window small: :meth:`~dask_pcm.templates.window.Window.shared`).
        ``extra``: chunks more than ``pcm.template.in-flight`` the copy asks to keep in
        flight to cover its round trips (:meth:`~dask_pcm.templates.window.Window.vote`);
        ``"extra"`` in the answer, where given: what the template's copies decided
        (:meth:`~dask_pcm.templates.window.Window.cover`)."""
        ...

    async def have(self, worker: str, indexes: list[int], **changes: list[int]) -> None:
        """``worker`` holds ``indexes`` now (and ``released``, ``lost``, ``bad``)."""
        ...


# Weight of the latest call in :attr:`DirectoryPlanner.round_trip`.
_RECENT = 0.25


class DirectoryPlanner:
    """Plans from the scheduler's chunk directory (peer to peer), timing its calls: what a
    report or a plan waits on the links and in the scheduler is time a holder's upload slot
    idles between two uploads."""

    def __init__(self, worker: Worker, digest: str) -> None:
        self.worker = worker
        self.digest = digest
        self.round_trip: float | None = None

    def _timed(self, seconds: float) -> None:
        last = self.round_trip
        self.round_trip = seconds if last is None else last + _RECENT * (seconds - last)

    async def plan(
        self, missing: list[int], limit: int, wait: float = 0.0, extra: int = 0
    ) -> dict[str, Any]:
        rpc = getattr(self.worker.scheduler, CHUNK_PLAN_OP)
        # Sent only when set: a scheduler of an older release takes no such argument.
        more = {"extra": extra} if extra else {}
        clock = asyncio.get_running_loop().time
        start = clock()
        answer = await rpc(
            digest=self.digest,
            worker=self.worker.address,
            missing=missing,
            limit=limit,
            wait=wait,
            **more,
        )
        if not wait:  # answered at once: the round trip alone
            self._timed(clock() - start)
        return answer

    async def have(self, worker: str, indexes: list[int], **changes: list[int]) -> None:
        rpc = getattr(self.worker.scheduler, CHUNK_HAVE_OP)
        clock = asyncio.get_running_loop().time
        start = clock()
        await rpc(digest=self.digest, worker=worker, indexes=indexes, **changes)
        self._timed(clock() - start)


class SourcePlanner:
    """Every chunk from the source (``pcm.template.peer-to-peer: false``)."""

    round_trip: float | None = None

    async def plan(
        self, missing: list[int], limit: int, wait: float = 0.0, extra: int = 0
    ) -> dict[str, Any]:
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
