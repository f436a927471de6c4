"""A virtual clock and a network of shared links, for simulating many workers in one process.

:class:`VirtualClockLoop` is an asyncio event loop whose clock jumps to the next timer when
nothing is ready to run (work in threads is waited for with the clock stopped);
:class:`Network` moves bytes through links of given capacities, shared equally by the flows
crossing them. :mod:`dask_pcm.testing.broadcast` runs the template broadcast on them.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import selectors
from dataclasses import dataclass
from typing import Any


# -- the clock ------------------------------------------------------------------------------
class _VirtualSelector(selectors.DefaultSelector):
    """Polls for real events; where the loop would sleep, moves its clock instead."""

    def __init__(self, loop: VirtualClockLoop) -> None:
        super().__init__()
        self.loop = loop

    def select(self, timeout: float | None = None) -> list[Any]:
        if not self.loop.threads and timeout:
            # Nothing outside the loop can wake it: straight to the next timer.
            self.loop.now += timeout
            return []
        events = super().select(0)
        if events or timeout == 0:
            return events
        if self.loop.threads:  # real work in a thread: wait for it, the clock stopped
            return super().select(1.0)
        if timeout is None:
            raise RuntimeError(
                "the simulation is stuck: every coroutine waits, and for no timer or thread"
            )
        self.loop.now += timeout
        return []


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop on simulated time: ``loop.time()`` only moves when every coroutine is
    waiting for a timer, and then straight to the earliest one."""

    def __init__(self) -> None:
        self.now = 0.0
        self.threads = 0
        super().__init__(_VirtualSelector(self))

    def time(self) -> float:
        return self.now

    def run_in_executor(self, executor: Any, func: Any, *args: Any) -> asyncio.Future[Any]:  # type: ignore[override]
        future = super().run_in_executor(executor, func, *args)
        self.threads += 1
        future.add_done_callback(self._thread_done)
        return future

    def _thread_done(self, _: Any) -> None:
        self.threads -= 1

    def shut(self) -> None:
        """Stop the executor's threads (waited for in real time, by a thread of its own)
        and close."""
        self.threads += 1
        try:
            self.run_until_complete(self.shutdown_default_executor())
        finally:
            self.threads -= 1
            self.close()


# -- the network ----------------------------------------------------------------------------
@dataclass(eq=False)
class _Flow:
    links: tuple[str, ...]
    left: float  # bytes still to move at ``since``
    done: asyncio.Future[None]
    since: float
    rate: float = 0.0
    version: int = 0  # which of its entries in the finish heap is current


class Network:
    """Links with capacities (bytes per second) shared equally by the flows crossing them.

    A flow moves at the smallest share along its path. A flow starting or ending changes
    the shares of the flows on its links only, so only those are recomputed; when each
    flow ends is kept in a heap.
    """

    def __init__(self, capacity: dict[str, float], latency: float) -> None:
        self.capacity = capacity
        self.latency = latency
        self.moved: dict[str, float] = {}  # bytes through each link
        self._on: dict[str, set[_Flow]] = {link: set() for link in capacity}
        self._finish: list[tuple[float, int, _Flow, int]] = []
        self._seq = itertools.count()
        self._timer: asyncio.TimerHandle | None = None

    async def transfer(self, links: tuple[str, ...], nbytes: float) -> None:
        """Move ``nbytes`` through ``links`` (after one latency)."""
        await asyncio.sleep(self.latency)
        loop = asyncio.get_running_loop()
        flow = _Flow(links, float(nbytes), loop.create_future(), loop.time())
        for link in links:
            self.moved[link] = self.moved.get(link, 0.0) + nbytes
            self._on[link].add(flow)
        self._rerate({f for link in links for f in self._on[link]}, loop.time())
        self._arm(loop)
        await flow.done

    def _rerate(self, flows: set[_Flow], now: float) -> None:
        for flow in flows:
            flow.left -= flow.rate * (now - flow.since)
            flow.since = now
            flow.rate = min(self.capacity[link] / len(self._on[link]) for link in flow.links)
            flow.version += 1
            finish = now + max(flow.left, 0.0) / flow.rate
            heapq.heappush(self._finish, (finish, next(self._seq), flow, flow.version))

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        while self._finish and self._finish[0][3] != self._finish[0][2].version:
            heapq.heappop(self._finish)  # superseded
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._finish:
            self._timer = loop.call_at(self._finish[0][0], self._tick, loop)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        now = loop.time()
        ended: list[_Flow] = []
        while self._finish and self._finish[0][0] <= now + 1e-9:
            _, _, flow, version = heapq.heappop(self._finish)
            if version == flow.version:
                ended.append(flow)
        touched: set[_Flow] = set()
        for flow in ended:
            flow.version += 1
            for link in flow.links:
                self._on[link].discard(flow)
                touched |= self._on[link]
            flow.done.set_result(None)
        self._rerate(touched.difference(ended), now)
        self._arm(loop)
