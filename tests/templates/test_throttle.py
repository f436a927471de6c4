"""The source rate limit (``pcm.template.source-bandwidth``): concurrent readers of a host
split one bandwidth."""

from __future__ import annotations

import multiprocessing
import pickle
import threading
import time
import uuid
from pathlib import Path

import pytest

from dask_pcm.templates.throttle import SharedBandwidth

MB = 1_000_000


def _read(link: SharedBandwidth, nbytes: int, chunks: int) -> None:
    for _ in range(chunks):
        link.consume(nbytes)


def test_one_reader_gets_the_whole_bandwidth():
    link = SharedBandwidth(50 * MB, name=f"t-{uuid.uuid4().hex}")
    start = time.perf_counter()
    _read(link, 5 * MB, 4)  # 20 MB at 50 MB/s
    assert 0.38 < time.perf_counter() - start < 0.8


def _timed_read(link: SharedBandwidth, out: list[float]) -> None:
    start = time.perf_counter()
    _read(link, 5 * MB, 4)
    out.append(time.perf_counter() - start)


def test_concurrent_readers_split_the_bandwidth():
    link = SharedBandwidth(100 * MB, name=f"t-{uuid.uuid4().hex}")
    times: list[float] = []
    threads = [threading.Thread(target=_timed_read, args=(link, times)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # 4 x 20 MB through 100 MB/s take 0.8 s, and every reader is slowed: alone, 0.2 s.
    assert max(times) >= 0.75
    assert min(times) >= 0.55


def test_readers_in_other_processes_share_it_too():
    link = SharedBandwidth(100 * MB, name=f"t-{uuid.uuid4().hex}")
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=_read, args=(link, 5 * MB, 16))  # 0.8 s alone
    proc.start()
    deadline = time.monotonic() + 30
    while not Path(link._path).exists():  # its first booking
        assert time.monotonic() < deadline
        time.sleep(0.01)
    times: list[float] = []
    _timed_read(link, times)  # 0.2 s alone
    proc.join(timeout=30)
    assert proc.exitcode == 0
    assert times[0] >= 0.3


def test_it_pickles_as_its_rate_and_name():
    link = SharedBandwidth(100 * MB, name="nfs server")
    clone = pickle.loads(pickle.dumps(link))
    assert (clone.bytes_per_second, clone.name) == (100 * MB, "nfs_server")
    with pytest.raises(ValueError, match="bandwidth must be positive"):
        SharedBandwidth(0)
