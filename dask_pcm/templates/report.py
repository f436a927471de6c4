"""What one template copy did: bytes from peers and the source, and each peer's part."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class PeerRecord:
    """What one peer did during one template copy."""

    chunks: int = 0
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
    # Chunks in flight at the end and at most (pcm.template.in-flight adapted to the link).
    window: int = 0
    peak_window: int = 0
    peers: dict[str, PeerRecord] = field(default_factory=dict)
    # Every chunk received: (index, the peer's address or "" for the source, when it was
    # asked for, when its bytes were in), on the wall clock (time.time()), so that the copies
    # of one broadcast can be laid side by side (``scale_out.py --hosts`` does).
    timeline: list[tuple[int, str, float, float]] = field(default_factory=list)

    @property
    def failed_peers(self) -> list[str]:
        """Peers dropped during the copy (unreachable, too slow, or serving bad chunks)."""
        return [p for p, r in self.peers.items() if r.dropped]

    def describe_peers(self) -> str:
        if not self.peers:
            return "no peer held it"
        return "; ".join(f"{p} {r.describe()}" for p, r in self.peers.items())

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k not in ("peers", "timeline")}
        out["failed_peers"] = self.failed_peers
        out["peers"] = {p: r.describe() for p, r in self.peers.items()}
        return out
