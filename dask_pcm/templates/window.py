"""How many chunks one template copy keeps in flight: found from what its link delivers.

A copy that fetches too few chunks at once leaves its link idle between them (a round trip
per chunk, a chunk verified and written while nothing arrives); one that fetches too many
only queues them on the link, delaying each chunk, and with it every peer waiting to be
passed that chunk on, and holds more memory. Which is which depends on the link (loopback,
a 24 Mbit/s uplink, a long path) and changes while the copy runs (peers come and go), so no
fixed number fits: :class:`Window` climbs to it. It measures the bytes delivered over one
window's worth of chunks at a time, grows by one chunk while the rate rises, steps back when
a step up brought nothing, and after a few samples at one size tries one more again. It
never leaves ``[1, cap]``: ``cap`` (``pcm.template.max-in-flight``) bounds the memory a copy
holds.

Example
-------
>>> window = Window(start=2, cap=8)
>>> window.started(now=0.0)
>>> for t in (1.0, 2.0):
...     window.received(64 << 20, now=t)   # two chunks, 64 MiB/s
>>> window.size                                 # the first sample: try one more
3
"""

from __future__ import annotations

__all__ = ["Window"]

# A rate counts as risen (or fallen) when it moves by more than this fraction: a copy's
# rate wobbles with the scheduler's and the disk's timing by a few per cent.
GAIN = 0.05
# Samples at an unchanged size before probing one chunk more again (the link may have
# freed up: a peer finished, another joined).
PROBE_AFTER = 4


class Window:
    """Chunks in flight for one copy, adapted to the rate the copy receives them at.

    Parameters
    ----------
    start
        The size before anything is known (``pcm.template.in-flight``).
    cap
        The most it may grow to (``pcm.template.max-in-flight``); ``start`` is lowered to it.
    """

    def __init__(self, start: int, cap: int) -> None:
        if cap < 1 or start < 1:
            raise ValueError(f"a window needs start and cap of at least 1, got {start}, {cap}")
        self.cap = cap
        self.size = min(start, cap)
        self.peak = self.size
        self._since: float | None = None
        self._bytes = 0
        self._chunks = 0
        self._last_rate: float | None = None
        self._grew = False
        self._backed = False
        self._steady = 0
        self.history: list[tuple[int, float]] = []  # (size, rate) of each sample

    def started(self, now: float) -> None:
        """The first request went out at ``now`` (the first sample is timed from it)."""
        if self._since is None:
            self._since = now

    def received(self, nbytes: int, now: float) -> None:
        """A chunk of ``nbytes`` arrived at ``now``; after a window's worth, adapt."""
        if self._since is None:
            self._since = now
            return  # no interval to time yet
        self._bytes += nbytes
        self._chunks += 1
        if self._chunks < self.size or now <= self._since:
            return
        rate = self._bytes / (now - self._since)
        self.history.append((self.size, rate))
        self._since, self._bytes, self._chunks = now, 0, 0
        last, self._last_rate = self._last_rate, rate
        if self._backed:  # the first sample after stepping back: the new reference
            self._backed = False
            return
        if last is None or rate > last * (1 + GAIN):
            self._step(+1)  # rising (or nothing known): one more
        elif self._grew:
            self._step(-1)  # the last step up brought nothing: back
        elif rate < last * (1 - GAIN) and self.size > 1:
            # Falling at an unchanged size: the link is shared more now; queue less on it.
            self._step(-1)
        else:
            self._steady += 1
            if self._steady >= PROBE_AFTER:
                self._step(+1)

    def _step(self, by: int) -> None:
        size = max(1, min(self.cap, self.size + by))
        self._grew = size > self.size
        # After a step back, the next sample is the new reference, not a fall to react to.
        self._backed = size < self.size
        self._steady = 0
        self.size = size
        self.peak = max(self.peak, size)
