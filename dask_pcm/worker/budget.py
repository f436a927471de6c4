"""The memory budget of one worker's resident contexts (``pcm.worker.context-memory-limit``).

Several contexts at level ``full`` may share a worker within the limit. Before a load, and
again once the real size is known, the least recently used *idle* contexts (no task holding
them) are evicted; an evicted context is rebuilt on demand by the next task that needs it.
One :class:`MemoryBudget` per worker (``worker.extensions["dask-pcm-budget"]``) serialises
these decisions between the worker's context plugins, which load in threads of their own.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from dask_pcm import config
from dask_pcm.protocol import READY

if TYPE_CHECKING:
    from distributed import Worker

    from dask_pcm.worker.holder import Holder

logger = logging.getLogger(__name__)

EXTENSION = "dask-pcm-budget"


class MemoryBudget:
    """Evicts least recently used idle resident contexts of one worker to make room."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    @classmethod
    def of(cls, worker: Worker) -> MemoryBudget:
        """The budget of ``worker``, created on first use."""
        with _create:
            budget = worker.extensions.get(EXTENSION)
            if budget is None:
                budget = worker.extensions[EXTENSION] = cls()
            return budget

    def make_room(self, holder: Holder, resident: list[Holder], incoming: int) -> None:
        """Evict idle contexts among ``resident`` (other than ``holder``'s) until
        ``incoming`` more bytes fit under the limit."""
        limit = config.context_memory_limit()
        if limit is None:
            return
        with self._lock:
            used = sum(h.lifecycle.get("nbytes") for h in resident if h.lifecycle.state == READY)
            used += incoming
            if used <= limit:
                return
            idle = sorted(
                (
                    h
                    for h in resident
                    if h is not holder and h.lifecycle.state == READY and not h.active
                ),
                key=lambda h: h.last_used,
            )
            for victim in idle:
                if used <= limit:
                    break
                used -= victim.evict()
        if used > limit:
            logger.warning(
                "Contexts on %s use %d bytes, over pcm.worker.context-memory-limit (%d): "
                "the others are in use",
                holder.lifecycle.get("worker"),
                used,
                limit,
            )


_create = threading.Lock()
