"""A chunk planner without a scheduler, for testing the fetcher's peer logic in isolation."""

from __future__ import annotations

from typing import Any


class StaticPeers:
    """Plans every missing chunk from the same ``peers`` (those the fetcher has dropped are
    skipped by it, and their chunks read from the source); remembers what it was told."""

    def __init__(self, peers: list[str]) -> None:
        self.peers = list(dict.fromkeys(peers))
        self.told: list[tuple[str, list[int], dict[str, list[int]]]] = []

    async def plan(self, missing: list[int], limit: int, wait: float = 0.0) -> dict[str, Any]:
        if not self.peers:
            return {"peers": {}, "source": list(missing[:limit])}
        return {"peers": {i: list(self.peers) for i in missing[:limit]}, "source": []}

    async def have(self, worker: str, indexes: list[int], **changes: list[int]) -> None:
        self.told.append((worker, indexes, changes))
