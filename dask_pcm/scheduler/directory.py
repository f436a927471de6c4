"""The chunk directory: who holds which chunk of a template being copied, and who reads
which chunk from the source.

Workers copying a template ask it for a plan (:meth:`ChunkDirectory.plan`) and report what
they hold (:meth:`ChunkDirectory.have`); see :mod:`dask_pcm.templates.fetch`. Workers that
join together thus split the source between them (a *lease* per chunk, at most
:data:`SOURCE_LEASES` per worker at once) and exchange the rest. A worker that served a chunk
with the wrong bytes is not offered for that chunk again.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Collection
from typing import Any

logger = logging.getLogger(__name__)

# Chunks one worker may be reading from a template's source at once, and how long such a
# lease lasts before another worker may take the chunk.
SOURCE_LEASES = 2
LEASE_SECONDS = 120.0


class ChunkDirectory:
    """Chunk holders, source leases and bad holders, per template digest.

    Parameters
    ----------
    whole_copies
        ``whole_copies(digest)``: the connected workers holding a complete copy.
    connected
        The connected workers' addresses (reports from others are ignored).
    """

    def __init__(
        self,
        whole_copies: Callable[[str], set[str]],
        connected: Callable[[], Collection[str]],
    ) -> None:
        self.whole_copies = whole_copies
        self.connected = connected
        self.holders: dict[str, dict[int, set[str]]] = {}
        self.leases: dict[str, dict[int, tuple[str, float]]] = {}
        # Workers that served a chunk failing verification: not offered for it again.
        self.bad_holders: dict[str, dict[int, set[str]]] = {}

    def plan(self, digest: str, worker: str, missing: list[int]) -> dict[str, Any]:
        """RPC handler: where ``worker`` should get each of its ``missing`` chunks now.

        Returns ``{"peers": {index: [workers]}, "source": [indexes]}``: peers (whole copies
        and partial ones) for every chunk someone holds, in random order; and a source lease
        for chunks nobody holds or is reading, at most :data:`SOURCE_LEASES` per worker at
        once. A lease lapses after :data:`LEASE_SECONDS` or when its worker leaves.
        """
        now = time.time()
        whole = self.whole_copies(digest)
        holders = self.holders.setdefault(digest, {})
        bad = self.bad_holders.get(digest, {})
        leases = self.leases.setdefault(digest, {})
        for index in [i for i, (_, until) in leases.items() if until < now]:
            del leases[index]
        mine = sum(1 for w, _ in leases.values() if w == worker)
        peers: dict[int, list[str]] = {}
        source: list[int] = []
        for index in missing:
            who = sorted((holders.get(index, set()) | whole) - bad.get(index, set()) - {worker})
            if who:
                random.shuffle(who)
                peers[index] = who
            elif index not in leases and mine < SOURCE_LEASES:
                leases[index] = (worker, now + LEASE_SECONDS)
                source.append(index)
                mine += 1
        return {"peers": peers, "source": source}

    def have(
        self,
        digest: str,
        worker: str,
        indexes: list[int],
        released: list[int] | None = None,
        lost: list[int] | None = None,
        bad: list[int] | None = None,
    ) -> None:
        """RPC handler: ``worker`` now holds ``indexes``; its leases on ``released`` end;
        it no longer offers ``lost`` (it failed to serve them, or gave up its copy); it
        served ``bad`` with the wrong bytes, so nobody is sent to it for them again."""
        if worker not in self.connected():
            return
        holders = self.holders.setdefault(digest, {})
        leases = self.leases.setdefault(digest, {})
        for index in lost or ():
            holders.get(index, set()).discard(worker)
        if bad:
            marked = self.bad_holders.setdefault(digest, {})
            first = not any(worker in who for who in marked.values())
            for index in bad:
                marked.setdefault(index, set()).add(worker)
            if first:  # once per worker and template: its copy is damaged
                logger.warning(
                    "%s served corrupted chunk(s) %s of template %s...: no longer offered for them",
                    worker,
                    bad,
                    digest[:12],
                )
        for index in indexes:
            holders.setdefault(index, set()).add(worker)
            leases.pop(index, None)
        for index in released or ():
            if leases.get(index, ("", 0.0))[0] == worker:
                del leases[index]

    def remove_worker(self, worker: str) -> None:
        """A worker left: it holds nothing, its leases lapse."""
        for directory in (self.holders, self.bad_holders):
            for by_index in directory.values():
                for who in by_index.values():
                    who.discard(worker)
        for leases in self.leases.values():
            for index in [i for i, (w, _) in leases.items() if w == worker]:
                del leases[index]
