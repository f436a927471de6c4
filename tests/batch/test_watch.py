"""The dispatch loop's wait for finished tasks: it wakes when one finishes, and gives up at
its timeout so that the loop can check its cluster."""

from __future__ import annotations

import threading
import time

from distributed import Event, as_completed

from dask_pcm.batch.watch import next_batch


def _wait_for(name: str) -> str:
    Event(name).wait()
    return name


def test_a_task_finishing_during_the_wait_ends_it_at_once(inproc_cluster):
    _, client = inproc_cluster
    future = client.submit(_wait_for, "go", pure=False)
    queue = as_completed([future])
    threading.Timer(0.5, Event("go", client=client).set).start()
    start = time.monotonic()
    batch = next_batch(queue, timeout=30)
    waited = time.monotonic() - start
    assert batch == [future]
    assert 0.4 < waited < 5, waited  # woken by the finish, not by the 30 s timeout


def test_nothing_finishing_returns_nothing_at_the_timeout(inproc_cluster):
    _, client = inproc_cluster
    future = client.submit(_wait_for, "never", pure=False)
    queue = as_completed([future])
    start = time.monotonic()
    assert next_batch(queue, timeout=0.5) == []
    assert 0.45 < time.monotonic() - start < 5
    Event("never", client=client).set()
    assert next_batch(queue, timeout=30) == [future]


def test_every_future_finished_already_comes_back_in_one_batch(inproc_cluster):
    _, client = inproc_cluster
    futures = client.map(lambda x: x, range(5))
    client.gather(futures)
    queue = as_completed(futures)
    time.sleep(0.2)  # as_completed learns of the finished futures on the event loop
    got: list = []
    while len(got) < 5:
        got += next_batch(queue, timeout=5)
    assert sorted(f.key for f in got) == sorted(f.key for f in futures)
    assert next_batch(queue, timeout=5) == []  # nothing left: no wait
