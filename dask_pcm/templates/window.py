"""How many chunks one template copy keeps in flight: found from what its link delivers.

A copy that fetches too few chunks at once leaves its link idle between them (a round trip
per chunk, a long path, a chunk verified and written while nothing arrives); one that
fetches too many only queues them on the link, delaying each chunk, and with it every peer
waiting to be passed that chunk on, and holds more memory. Which is which depends on the
link (loopback, a 24 Mbit/s uplink, a long path) and changes while the copy runs, so no
fixed number fits.

:class:`Window` climbs to it. It measures the bytes received over a window's worth of
chunks at a time (a *sample*), tries one chunk more, and keeps it only if the rate rose by
at least a quarter of what one more chunk would add to a link with room (:data:`KEEP`):
otherwise it steps back, and tries again after :data:`PROBE_AFTER` samples; it steps
back too when the rate falls at one size (the link is shared more now). A sample in
which the copy had slots it could not fill (it waited for peers to get the chunks it
lacks) says nothing about the window and is dropped. While other workers copy the template
too (a broadcast), the window stays at ``floor`` (:meth:`Window.shared`): their links are
shared, and a chunk more for one copy is a share taken from another and a delay for the
peers waiting to be passed each chunk on. It never leaves ``[floor, cap]``:
``cap`` (``pcm.template.max-in-flight``) bounds the memory a copy holds; ``floor``
(``pcm.template.in-flight``) is what a copy keeps however slow its link.

Example
-------
>>> window = Window(start=2, cap=8)
>>> window.started(now=0.0)
>>> for t in (1.0, 2.0):                  # two chunks, one a second
...     window.received(64 << 20, now=t)
>>> window.size                           # the first sample: try one more
3
"""

from __future__ import annotations

__all__ = ["Window"]

# The share of what one more chunk adds to a link with room (1 / (size - 1)) that a probe
# must gain to be kept.
KEEP = 0.25
# Samples at one size before probing one chunk more again (the link may have room now: a
# peer finished, another joined).
PROBE_AFTER = 4


class Window:
    """Chunks in flight for one copy, adapted to the rate the copy receives them at.

    Parameters
    ----------
    start
        The size before anything is known, and the least it steps back to
        (``pcm.template.in-flight``).
    cap
        The most it may grow to (``pcm.template.max-in-flight``); ``start`` is lowered to it.
    """

    def __init__(self, start: int, cap: int) -> None:
        if cap < 1 or start < 1:
            raise ValueError(f"a window needs start and cap of at least 1, got {start}, {cap}")
        self.cap = cap
        self.floor = self.size = min(start, cap)
        self.peak = self.size
        self._since: float | None = None
        self._bytes = 0
        self._chunks = 0
        self._reference: float | None = None  # the rate at the size before the last probe
        self._probing = False
        self._steady = 0
        self.history: list[tuple[int, float]] = []  # (size, rate) of each sample

    def started(self, now: float) -> None:
        """Chunks were asked for at ``now`` (the first sample is timed from the first)."""
        if self._since is None:
            self._since = now

    def starved(self, now: float) -> None:
        """The copy had free slots and nothing to fill them with: drop the sample."""
        self._since, self._bytes, self._chunks = now, 0, 0

    def shared(self, now: float) -> None:
        """Other copies of the template run too (a broadcast): back to ``floor``, samples
        dropped. Their links are shared; a chunk more in flight would take a share from
        another copy and delay the chunks others wait to be passed on."""
        self.starved(now)
        self.size = self.floor
        self._reference, self._probing, self._steady = None, False, 0

    def received(self, nbytes: int, now: float) -> None:
        """A chunk of ``nbytes`` arrived at ``now``; after a window's worth, adapt."""
        if self._since is None:
            self._since = now
            return
        self._bytes += nbytes
        self._chunks += 1
        if self._chunks < self.size or now <= self._since:
            return
        rate = self._bytes / (now - self._since)
        self.history.append((self.size, rate))
        self._since, self._bytes, self._chunks = now, 0, 0
        if self._probing:
            self._probing = False
            assert self._reference is not None
            # One more chunk adds 1/(size-1) to a link with room: keep it for a quarter of
            # that (more than a copy's rate wobbles by, less than a long path gains).
            if rate >= self._reference * (1 + KEEP / (self.size - 1)):
                self._probe(rate)  # it paid: try one more at once
            else:
                self.size -= 1  # it did not: back, and the next sample is the reference
                self._reference = None
            return
        if self._reference is None:
            self._reference = rate
            if self.size == self.floor and len(self.history) == 1:
                self._probe(rate)  # the first sample: try one more at once
            return
        if self.size > self.floor and rate < self._reference * (1 - 0.5 / self.size):
            # Falling at one size: the link is shared more now; queue less on it.
            self.size -= 1
            self._reference = None
            return
        self._reference = rate
        self._steady += 1
        if self._steady >= PROBE_AFTER:
            self._probe(rate)

    def _probe(self, rate: float) -> None:
        self._steady = 0
        if self.size < self.cap:
            self._reference = rate
            self.size += 1
            self._probing = True
            self.peak = max(self.peak, self.size)
