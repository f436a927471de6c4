"""A rate limit on reading template sources: one bandwidth shared by every reader on a host.

On a cluster, a template's source is usually a shared filesystem (NFS, Panasas, Lustre);
when a hundred workers start at once they split its bandwidth, and a storm of reads can slow
the filesystem down for every other user of it. ``pcm.template.source-bandwidth`` caps what
the workers of one host read from template sources together (copies of chunks nobody else
holds, and every build at level ``agnostic``): each read first books a time
slot on a single link of that many bytes per second, shared by all threads and processes of
the host through a small state file under an ``flock`` in ``pcm.lock-directory``. Slots are
handed out first come, first served, so ``n`` concurrent readers each see about ``1/n`` of
the bandwidth and together never exceed it. Peer-to-peer transfers are not limited: they do
not touch the source.

The same link, set to a shared filesystem's speed, is how tests and benchmarks on one
machine model such a filesystem.

Example
-------
>>> link = SharedBandwidth(100e6, name="nfs")     # 100 MB/s for the whole host
>>> link.consume(64 * 2**20)                      # doctest: +SKIP  (waits ~0.67 s if idle)
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
import time

from dask_pcm.locks import lock_dir

_STATE = struct.Struct("d")  # the time (epoch seconds) at which the link is next free


class SharedBandwidth:
    """A link of ``bytes_per_second`` shared by every reader of this host that uses ``name``.

    Picklable: only the rate and the name travel, so a worker process that unpickles it shares
    the same link as every other process on its host.
    """

    def __init__(self, bytes_per_second: float, name: str = "shared-fs") -> None:
        if not bytes_per_second > 0:
            raise ValueError(f"bandwidth must be positive, got {bytes_per_second!r}")
        self.bytes_per_second = float(bytes_per_second)
        self.name = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)

    def __repr__(self) -> str:
        return f"SharedBandwidth({self.bytes_per_second / 1e6:g} MB/s, name={self.name!r})"

    def __reduce__(self) -> tuple[object, ...]:
        return (SharedBandwidth, (self.bytes_per_second, self.name))

    @property
    def _path(self) -> str:
        return os.fspath(lock_dir() / f"bandwidth-{self.name}.state")

    def book(self, nbytes: int) -> float:
        """Reserve the link for ``nbytes``; return the time (epoch seconds) the read ends."""
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            raw = os.pread(fd, _STATE.size, 0)
            free_at = _STATE.unpack(raw)[0] if len(raw) == _STATE.size else 0.0
            start = max(time.time(), free_at)
            end = start + nbytes / self.bytes_per_second
            os.pwrite(fd, _STATE.pack(end), 0)
            return end
        finally:
            os.close(fd)  # closing the descriptor releases the lock

    def consume(self, nbytes: int) -> float:
        """Block until ``nbytes`` have gone through the link; return the seconds waited."""
        end = self.book(nbytes)
        wait = end - time.time()
        if wait > 0:
            time.sleep(wait)
        return max(0.0, wait)

    def reset(self) -> None:
        """Forget the bookings (start of a benchmark round)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path)
