"""The scheduler plugin: placement on ready workers, failures, stealing, eviction, status.

Workers run in this process (``processes=False``), so a module-level gate controls what a
worker's loader does when it joins: load at once, block until the test opens the gate, or
fail with a message the test then expects in the task's error.

Tests wait on the scheduler, never for a fixed time: for a context's state, on the scheduler
plugin's readiness waiter (woken by every report); for task states, on :class:`TaskStates`, a
scheduler plugin of the tests woken by every transition. What must *not* happen is read from
the scheduler's record of transitions afterwards, not watched for a while.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import dask
import pytest
from distributed import Client, LocalCluster, SchedulerPlugin, get_worker

import dask_pcm
from dask_pcm import ContextLoadError
from dask_pcm.scheduler import get_plugin
from tests.conftest import cluster_client

GATE = threading.Event()
MODE = {"block": False, "fail": False}


class GatedLoader:
    """Builds a small object; blocks on ``GATE`` or fails as ``MODE`` says at load time."""

    def __call__(self, location: str) -> dict[str, str]:
        if MODE["fail"]:
            raise RuntimeError(f"CUDA out of memory (on purpose) loading {location}")
        if MODE["block"]:
            assert GATE.wait(60), "test gate never opened"
            if MODE["fail"]:
                raise RuntimeError(f"CUDA out of memory (on purpose) loading {location}")
        return {"location": location}


class Blob:
    """A context of a declared size, for the memory budget."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


class BlobLoader:
    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    def __call__(self, location: str) -> Blob:
        return Blob(self.nbytes)


def where(x: int = 0, delay: float = 0.0) -> str:
    time.sleep(delay)
    return get_worker().address


class TaskStates(SchedulerPlugin):
    """The tests' eyes on the scheduler: waiters woken whenever a task changes state."""

    name = "test-task-states"

    def __init__(self) -> None:
        self.waiters: dict[asyncio.Event, Any] = {}

    def transition(self, key: Any, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        for event, satisfied in list(self.waiters.items()):
            if satisfied():
                event.set()


@pytest.fixture
def one_worker() -> Iterator[tuple[LocalCluster, Client]]:
    GATE.clear()
    MODE.update(block=False, fail=False)
    with cluster_client() as client:
        client.register_plugin(TaskStates())
        yield client.cluster, client
    GATE.set()  # never leave a loader thread blocked


def _workers(client: Client) -> set[str]:
    return set(client.scheduler_info()["workers"])


def _add_worker(cluster: LocalCluster, client: Client) -> str:
    before = _workers(client)
    cluster.scale(len(before) + 1)
    client.wait_for_workers(len(before) + 1, timeout=30)
    (added,) = _workers(client) - before
    return added


def _state(client: Client, context: str, worker: str) -> str | None:
    table = dask_pcm.status(client, [context])
    rows = table[table["worker"] == worker]
    return None if rows.empty else str(rows["state"].iloc[0])


async def _context_reaches(context: str, worker: str, state: str, dask_scheduler=None) -> Any:
    plugin = get_plugin(dask_scheduler)

    def now() -> str | None:
        return next((r["state"] for r in plugin.rows([context]) if r["worker"] == worker), None)

    await plugin.readiness.until(lambda: now() == state, 20)
    return now()


def _wait_state(client: Client, context: str, worker: str, state: str) -> None:
    now = client.run_on_scheduler(_context_reaches, context, worker, state)
    assert now == state, f"{worker} stayed {now}, expected {state}"


async def _tasks_reach(keys: list, allowed: set[str], dask_scheduler=None) -> set[str]:
    """Wait until every task of ``keys`` is in one of the ``allowed`` states; their states."""
    watch = dask_scheduler.plugins[TaskStates.name]

    def now() -> set[str]:
        return {dask_scheduler.tasks[k].state for k in keys if k in dask_scheduler.tasks}

    def reached() -> bool:
        return all(k in dask_scheduler.tasks for k in keys) and now() <= allowed

    if not reached():
        event = asyncio.Event()
        watch.waiters[event] = reached
        try:
            await asyncio.wait_for(event.wait(), 20)
        except TimeoutError:
            pass
        finally:
            del watch.waiters[event]
    return now()


def _wait_task_states(client: Client, futures: list, allowed: set[str]) -> None:
    """Wait until every task of ``futures`` is in one of the ``allowed`` states."""
    now = client.run_on_scheduler(_tasks_reach, [f.key for f in futures], allowed)
    assert now <= allowed, f"tasks stayed {now}, expected {allowed}"


def _into_processing(key: Any, dask_scheduler=None) -> list[tuple[str, str]]:
    """(state it came from, stimulus) of each time the task ``key`` went to a worker."""
    return [(t[1], t[4]) for t in dask_scheduler.story(key) if t[0] == key and t[2] == "processing"]


def _ready_then_join(cluster: LocalCluster, client: Client, mode: str) -> tuple[str, str]:
    """Register "gated" on the one worker, then add a second whose load blocks or fails."""
    dask_pcm.register(client, dask_pcm.Context("gated", GatedLoader(), template="m"))
    (first,) = _workers(client)
    MODE[mode] = True
    second = _add_worker(cluster, client)
    _wait_state(client, "gated", second, {"block": "loading", "fail": "failed"}[mode])
    return first, second


def _only_a_loading_worker(cluster: LocalCluster, client: Client) -> str:
    """Register on one worker, add a second that blocks loading, retire the first."""
    first, second = _ready_then_join(cluster, client, "block")
    client.retire_workers([first], close_workers=True)  # returns once it is gone
    assert _workers(client) == {second}
    return second


def test_tasks_go_to_the_ready_worker_until_the_other_is_ready(one_worker):
    cluster, client = one_worker
    first, second = _ready_then_join(cluster, client, "block")

    early = dask_pcm.map(client, where, range(20), context="gated", delay=0.02)
    assert set(client.gather(early)) == {first}
    assert _state(client, "gated", second) == "loading"

    GATE.set()
    _wait_state(client, "gated", second, "ready")
    late = dask_pcm.map(client, where, range(20, 60), context="gated", delay=0.05)
    assert set(client.gather(late)) == {first, second}
    table = dask_pcm.status(client, ["gated"]).set_index("worker")
    assert table.loc[first, "tasks"] + table.loc[second, "tasks"] == 60
    assert table.loc[second, "tasks"] > 0


def test_work_queued_while_all_were_ready_stays_off_a_worker_that_joins(one_worker):
    cluster, client = one_worker
    dask_pcm.register(client, dask_pcm.Context("gated", GatedLoader(), template="m"))
    (first,) = _workers(client)
    # Every worker is ready: these go unrestricted, queued by Dask like plain tasks...
    futures = dask_pcm.map(client, where, range(60), context="gated", delay=0.05, pure=False)
    MODE["block"] = True
    second = _add_worker(cluster, client)  # ...until a worker joins that is not ready.
    _wait_state(client, "gated", second, "loading")
    ran_on = client.gather(futures)
    assert set(ran_on) == {first}
    GATE.set()


def test_a_failed_worker_gets_no_context_task_but_plain_tasks(one_worker):
    cluster, client = one_worker
    good, bad = _ready_then_join(cluster, client, "fail")

    ran_on = client.gather(dask_pcm.map(client, where, range(30), context="gated", delay=0.02))
    assert set(ran_on) == {good}
    plain = client.gather(client.map(where, range(30), delay=0.02, pure=False))
    assert bad in set(plain)  # the failed worker is otherwise healthy and used
    row = dask_pcm.status(client, ["gated"]).set_index("worker").loc[bad]
    assert row["tasks"] == 0
    assert "CUDA out of memory (on purpose)" in row["error"]


@pytest.fixture
def two_loads_at_once() -> Iterator[None]:
    # A joining worker's failing load must not queue behind another that blocks.
    with dask.config.set({"pcm.worker.load-concurrency": 2}):
        yield


def test_stolen_tasks_land_only_on_ready_workers(one_worker, two_loads_at_once):
    cluster, client = one_worker
    first, second = _ready_then_join(cluster, client, "block")
    MODE["fail"] = True
    third = _add_worker(cluster, client)
    _wait_state(client, "gated", third, "failed")

    # All of these are placed on the only ready worker...
    futures = dask_pcm.map(client, where, range(40), context="gated", delay=0.1, pure=False)
    _wait_task_states(client, futures, {"processing", "memory"})  # all on the first
    MODE["fail"] = False
    GATE.set()  # ...then the second becomes ready: work stealing moves some there.
    ran_on = client.gather(futures)
    assert second in set(ran_on), "no task was stolen by the worker that became ready"
    assert set(ran_on) == {first, second}  # never the failed third

    def thieves(dask_scheduler=None):
        # Stealing logs ("confirm", key, state, victim, thief, stimulus_id) per move made.
        return {
            event[4] for _, event in dask_scheduler.get_events("stealing") if event[0] == "confirm"
        }

    assert client.run_on_scheduler(thieves) == {second}


def test_tasks_err_with_the_loader_error_when_every_worker_failed(one_worker):
    cluster, client = one_worker
    second = _only_a_loading_worker(cluster, client)
    futures = dask_pcm.map(client, where, range(5), context="gated")
    _wait_task_states(client, futures, {"no-worker"})  # waiting for the loading worker
    MODE["fail"] = True
    GATE.set()
    for future in futures:
        with pytest.raises(ContextLoadError, match="CUDA out of memory") as info:
            future.result(timeout=10)
        assert second in info.value.failures
    # Work submitted afterwards fails at once too.
    with pytest.raises(ContextLoadError, match="failed on every worker"):
        dask_pcm.submit(client, where, 99, context="gated").result(timeout=10)


def test_allow_other_workers_runs_on_a_worker_still_loading(one_worker):
    cluster, client = one_worker
    worker = _only_a_loading_worker(cluster, client)
    strict = dask_pcm.submit(client, where, 1, context="gated")
    loose = dask_pcm.submit(client, where, 2, context="gated", allow_other_workers=True)
    _wait_task_states(client, [strict], {"no-worker"})
    _wait_task_states(client, [loose], {"processing"})  # waits on the worker instead
    GATE.set()
    assert loose.result(timeout=10) == worker
    assert strict.result(timeout=10) == worker
    # The strict task went to the worker once only, from no-worker, when the worker's
    # "ready" report reached the scheduler (the stimulus of the plugin's refresh), not before.
    ((came_from, stimulus),) = client.run_on_scheduler(_into_processing, strict.key)
    assert came_from == "no-worker" and stimulus.startswith("pcm-ready-"), stimulus


def _summary(dask_scheduler=None) -> dict:
    from dask_pcm.scheduler import get_plugin

    return get_plugin(dask_scheduler).summary()


def test_the_summary_tells_queued_work_from_work_waiting_for_a_ready_worker(one_worker):
    # The page said "tasks waiting 0" while most units were queued: it counted only tasks
    # that no worker with the context ready could take.
    cluster, client = one_worker
    _only_a_loading_worker(cluster, client)
    strict = [dask_pcm.submit(client, where, i, context="gated") for i in range(2)]
    loose = dask_pcm.submit(client, where, 9, context="gated", allow_other_workers=True)
    _wait_task_states(client, strict, {"no-worker"})
    _wait_task_states(client, [loose], {"processing"})
    gated = client.run_on_scheduler(_summary)["gated"]
    assert (gated["pending_tasks"], gated["waiting_tasks"]) == (3, 2)
    GATE.set()
    client.gather([*strict, loose])
    gated = client.run_on_scheduler(_summary)["gated"]
    assert (gated["tasks"], gated["pending_tasks"], gated["waiting_tasks"]) == (3, 0, 0)


def test_three_contexts_with_a_budget_for_two_evict_the_least_recently_used(one_worker):
    _, client = one_worker
    (worker,) = _workers(client)
    mib = 2**20
    with dask.config.set({"pcm.worker.context-memory-limit": "2.5 MiB"}):
        for name in ("a", "b"):
            dask_pcm.register(client, dask_pcm.Context(name, BlobLoader(mib)))
        dask_pcm.submit(client, where, context="a").result()  # now b is the least recent
        dask_pcm.register(client, dask_pcm.Context("c", BlobLoader(mib)))
        _wait_state(client, "b", worker, "evicted")
        table = dask_pcm.status(client).set_index("context")
        assert list(table["state"]) == ["ready", "evicted", "ready"]
        assert table.loc["b", "evictions"] == 1
        assert table.loc["a", "nbytes"] == mib

        # b is needed again: rebuilt on demand, evicting the least recent of a and c (a).
        assert dask_pcm.submit(client, where, context="b").result(timeout=20) == worker
        _wait_state(client, "a", worker, "evicted")
        table = dask_pcm.status(client).set_index("context")
        assert table.loc["b", "state"] == "ready"
        assert table.loc["b", "loads"] == 2
        assert table.loc["c", "state"] == "ready"
        assert table[table["state"] == "ready"]["nbytes"].sum() <= 2.5 * mib


OTHERS_AT_BUILD: list[dict[str, str]] = []


class ObservingLoader:
    """A 2 MiB context that says so before it loads, and notes the states of the worker's
    other contexts as it builds."""

    def estimate_bytes(self, location: str) -> int:
        return 2 * 2**20

    def __call__(self, location: str) -> Blob:
        from dask_pcm.worker import context_plugins

        (worker,) = OBSERVED_WORKERS  # in this process (processes=False)
        plugins = context_plugins(worker)
        OTHERS_AT_BUILD.append({n: p.state for n, p in plugins.items() if n != "big"})
        return Blob(2 * 2**20)


OBSERVED_WORKERS: list = []


def test_a_first_load_makes_room_for_what_the_loader_expects_before_building(one_worker):
    # Without it the new context was built beside the old ones and only then fitted in: on a
    # GPU, an out-of-memory error instead of an eviction.
    cluster, client = one_worker
    OTHERS_AT_BUILD.clear()
    with dask.config.set({"pcm.worker.context-memory-limit": "2.5 MiB"}):
        dask_pcm.register(client, dask_pcm.Context("small", BlobLoader(2**20)))
        OBSERVED_WORKERS[:] = cluster.workers.values()
        dask_pcm.register(client, dask_pcm.Context("big", ObservingLoader()))
    assert OTHERS_AT_BUILD == [{"small": "evicted"}]


def test_status_json_route_matches_status_and_metrics(one_worker):
    cluster, client = one_worker
    _add_worker(cluster, client)
    dask_pcm.register(client, dask_pcm.Context("gated", GatedLoader(), template="m"))
    client.gather(dask_pcm.map(client, where, range(6), context="gated"))
    base = client.dashboard_link.rsplit("/", 1)[0]

    with urllib.request.urlopen(f"{base}/pcm/status.json", timeout=10) as response:
        doc = json.load(response)
    table = dask_pcm.status(client)
    drop = ["state_seconds"]  # time-dependent
    assert [{k: v for k, v in r.items() if k not in drop} for r in doc["rows"]] == (
        table.drop(columns=drop).to_dict("records")
    )
    assert doc["columns"] == list(table.columns)  # one schema: protocol.ContextStatus
    assert {c for c, *_ in doc["page_columns"]} <= set(doc["columns"])
    assert doc["contexts"]["gated"]["workers"] == {"ready": 2}
    assert doc["contexts"]["gated"]["tasks"] == 6

    with urllib.request.urlopen(f"{base}/pcm/status", timeout=10) as response:
        page = response.read().decode()
    assert "contexts per worker" in page

    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as response:
        metrics = response.read().decode()
    assert 'dask_pcm_ready_workers{context="gated"} 2.0' in metrics
    assert 'dask_pcm_load_seconds_count{context="gated"} 2.0' in metrics
    served = [
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith('dask_pcm_tasks_total{context="gated"')
    ]
    assert sum(served) == 6


def test_losses_of_splittable_tasks_do_not_log_errors_on_the_scheduler():
    """distributed logs ERROR "Task … marked as failed because 4 workers died" for a task of
    the batch layer after one worker died (its count of deaths starts at the preset): on a
    preempted cluster that read as failures, one per task. Others' tasks keep the ERROR."""
    import logging

    from dask_pcm.scheduler.plugin import QuietLosses

    message = "Task %s marked as failed because %d workers died while trying to run it"

    def record(key: str) -> logging.LogRecord:
        return logging.LogRecord("distributed.scheduler", logging.ERROR, __file__, 1, message,
                                 (key, 4), None)  # fmt: skip

    quiet = QuietLosses()
    ours, theirs = record("pcm-direct--00001-x4-abcd"), record("inc-123")
    assert quiet.filter(ours) is False and ours.levelno == logging.DEBUG
    assert quiet.filter(theirs) is True and theirs.levelno == logging.ERROR
    # A result whose worker left before the client fetched it: computed again, a warning.
    gather = "Couldn't gather keys: %s"
    lost = logging.LogRecord("distributed.scheduler", logging.ERROR, __file__, 1, gather,
                             ({"pcm-direct--00120-x3-5ffd": "processing"},), None)  # fmt: skip
    other = logging.LogRecord("distributed.scheduler", logging.ERROR, __file__, 1, gather,
                              ({"pcm-a-1": "memory", "inc-1": "memory"},), None)  # fmt: skip
    assert quiet.filter(lost) is True and lost.levelname == "WARNING"
    assert quiet.filter(other) is True and other.levelno == logging.ERROR
