"""Checks a run makes while it waits on its cluster, so that no wait is for ever.

:func:`check_cluster` raises when the wait cannot end: the client lost its scheduler
(:class:`~dask_pcm.exceptions.ClusterLostError`, naming its address), or its cluster cannot
get any worker (its ``raise_if_stuck()``: :class:`~dask_pcm.exceptions.BatchJobError`
quoting the batch system; for any other ``SpecCluster``, a local one of the user's, no
worker object running and no ``adapt``: :class:`~dask_pcm.exceptions.NoWorkerError`).
The dispatch loop calls it every second; :func:`watched_result` waits for one future the
same way. :func:`scheduler_answers` tells a scheduler that is gone
from one that closed one call.
"""

from __future__ import annotations

import time
import weakref
from typing import Any

from distributed import Client, Future, SpecCluster, as_completed, wait

from dask_pcm.deploy.local import NoWorkerWatch
from dask_pcm.exceptions import ClusterLostError

#: Seconds between checks while waiting.
TICK = 1.0

# Clusters without a raise_if_stuck of their own, watched for having no worker.
_WATCHES: weakref.WeakKeyDictionary[SpecCluster, NoWorkerWatch] = weakref.WeakKeyDictionary()


def check_cluster(client: Client, unfinished: int | None = None) -> None:
    """Raise if waiting on ``client``'s cluster cannot end (see the module docstring);
    ``unfinished``: tasks still out, for the message."""
    if client.status not in ("running", "newly-created"):
        left = "" if unfinished is None else f"; {unfinished} task(s) unfinished"
        raise scheduler_lost(client, f"client {client.status}{left}")
    cluster = client.cluster
    stuck = getattr(cluster, "raise_if_stuck", None)
    if stuck is not None:
        stuck()
    elif isinstance(cluster, SpecCluster):  # anyone's local cluster, say
        _WATCHES.setdefault(cluster, NoWorkerWatch()).check(cluster)


def scheduler_answers(client: Client, timeout: float = 5 * TICK) -> bool:
    """Whether ``client``'s scheduler answers a fresh call within ``timeout`` seconds.

    A closed comm alone does not say the scheduler is gone: a handler of the scheduler that
    calls a worker (a scatter's hand-over of the data) closes the client's comm when that
    worker dies during the call, as if the client's own connection had dropped.
    """
    if client.status not in ("running", "newly-created") or client.scheduler is None:
        return False
    try:
        client.sync(client.scheduler.identity, callback_timeout=timeout)
    except Exception:
        return False
    return True


def scheduler_lost(client: Client, why: str) -> ClusterLostError:
    """The error for a run whose client lost its scheduler, naming its address."""
    return ClusterLostError(
        f"lost the connection to the scheduler at {scheduler_address(client)} ({why}): the "
        "scheduler died, or the network to it dropped"
    )


def scheduler_address(client: Client) -> str:
    """The address of ``client``'s scheduler, also once the client closed (its ``scheduler``
    is None then, and what the scheduler told it forgotten): its cluster's, or the address
    it was started with."""
    address = getattr(client.scheduler, "address", None)
    if not address:
        address = getattr(client.cluster, "scheduler_address", None)
    if not address and isinstance(getattr(client, "_start_arg", None), str):
        address = client._start_arg  # Client("tcp://...")
    return str(address or "unknown")


def watched_result(client: Client, future: Future) -> Any:
    """``future.result()``, checking the cluster every :data:`TICK` seconds meanwhile."""
    while True:
        try:
            wait(future, timeout=TICK)
        except TimeoutError:
            check_cluster(client)
            continue
        if future.status == "cancelled":
            check_cluster(client)
        return future.result()


def next_batch(queue: as_completed, timeout: float) -> list[Future]:
    """The futures finished by now, waiting up to ``timeout`` seconds for a first one.

    It sleeps on the condition ``queue`` notifies as each future finishes, as distributed's
    own blocking ``next`` does (a private attribute: without it, short sleeps), so that the
    client wakes when there is work rather than 50 times a second.
    """
    deadline = time.monotonic() + timeout
    condition = getattr(queue, "thread_condition", None)
    batch = queue.next_batch(block=False)
    while not batch and not queue.is_empty():
        left = deadline - time.monotonic()
        if left <= 0:
            break
        if condition is None:
            time.sleep(min(0.02, left))
        else:
            with condition:
                # Checked under the lock that a finishing future notifies under: no wake-up
                # is missed between the check and the wait.
                if not queue.has_ready():
                    condition.wait(min(0.1, left))
        batch = queue.next_batch(block=False)
    return batch
