"""Dispatch: units packed into tasks, a bounded number in flight, every unit once."""

from __future__ import annotations

import logging
import threading

import dask
import pytest

import dask_pcm
from dask_pcm.batch.dispatch import Dispatch
from dask_pcm.batch.sizing import MAX_UNITS_PER_TASK, Sizing
from dask_pcm.batch.units import Layout, Work, make_units

CONTEXT = "llm"


def _tokens(rows, suffix=""):
    lm = dask_pcm.get_context(CONTEXT)
    with lm.lock:
        return [{"tokens": len(lm.tokenizer(r["text"] + suffix)["input_ids"])} for r in rows]


WORK = Work(_tokens, contexts=(CONTEXT,), layout=Layout("id", "group"))


@pytest.fixture
def cluster(inproc_cluster, tiny_model_dir):
    cluster, client = inproc_cluster
    dask_pcm.register(client, dask_pcm.causal_lm(tiny_model_dir, name=CONTEXT), level="full")
    yield cluster, client
    dask_pcm.unregister(client, CONTEXT)


def _units(per_task: int = 1):
    rows = [{"id": i, "text": f"claim {i}"} for i in range(30)]
    return make_units(rows, per_task, {"a": {}, "b": {"suffix": "!"}})


def test_no_more_tasks_than_the_limit_reach_the_scheduler(cluster):
    """The old run submitted every unit at once: 60 tasks on the scheduler."""
    cluster, client = cluster
    running: list[int] = []
    held: list[int] = []
    got: list[str] = []

    def finished(name, table):
        tasks = [t for k, t in cluster.scheduler.tasks.items() if str(k).startswith("pcm-")]
        running.append(sum(t.state != "memory" for t in tasks))
        held.append(len(tasks))  # results not yet released count too
        got.append(name)

    units = _units()
    dispatch = Dispatch(client, units, WORK, finished, in_flight=3)
    dispatch.run()
    assert sorted(got) == sorted(u.name for u in units)  # every unit, once
    assert max(running) <= 3
    assert max(held) < 10


def _mentions(message, needle: bytes) -> bool:
    """Whether ``needle`` is anywhere in ``message`` (pickled parts included)."""
    import cloudpickle

    if isinstance(message, bytes | bytearray | memoryview):
        return needle in bytes(message)
    if isinstance(message, str):
        return needle.decode() in message
    if isinstance(message, dict):
        return any(_mentions(k, needle) or _mentions(v, needle) for k, v in message.items())
    if isinstance(message, list | tuple | set):
        return any(_mentions(m, needle) for m in message)
    try:
        return needle in cloudpickle.dumps(message)
    except Exception:
        return needle.decode() in repr(message)


def test_no_task_message_carries_row_text(cluster):
    """A wave's rows go to a worker once, as one key; its tasks carry index ranges. Before,
    every task message held its rows, and distributed keeps the last 1,000 messages of each
    stream: at paper scale the client (the scheduler in it) grew by a gigabyte."""
    cluster, client = cluster
    rows = [{"id": i, "text": f"needle-{i:03d} in the rows"} for i in range(30)]
    units = make_units(rows, 2, {"a": {}, "b": {"suffix": "!"}})
    got: dict[str, int] = {}
    Dispatch(client, units, WORK, lambda name, table: got.update({name: table.num_rows})).run()
    assert got == {u.name: 2 for u in units}
    scheduler = cluster.scheduler
    streams = [client.scheduler_comm, *scheduler.client_comms.values()]
    streams += [
        *scheduler.stream_comms.values(),
        *(w.batched_stream for w in cluster.workers.values()),
    ]
    logged = [m for bs in streams for m in bs.recent_message_log]
    assert any(_mentions(m, b"compute-task") for m in logged)  # the logs are there
    assert not [m for m in logged if _mentions(m, b"needle-")]


def test_units_are_packed_into_fewer_tasks_as_their_time_is_learned(cluster):
    _, client = cluster
    units = _units()
    got: dict[str, int] = {}
    with dask.config.set({"pcm.batch.task-seconds": 60}):  # as many as the limits allow
        dispatch = Dispatch(
            client, units, WORK, lambda n, t: got.update({n: t.num_rows}), in_flight=1
        )
        dispatch.run()
    assert got == {u.name: len(u.rows) for u in units}
    # First one unit (nothing measured yet), then shares of what is left per worker thread.
    assert dispatch.tasks < len(units) / 2
    assert dispatch.sizing.units_per_task(len(dispatch.queue)) > 1 or not dispatch.queue
    assert dispatch.sizing.unit_seconds is not None and dispatch.sizing.unit_seconds > 0


def test_units_per_task_follows_the_measured_time():
    class FakeClient:
        def nthreads(self):
            return {"a": 1, "b": 1}

    units = _units()
    sizing = Sizing(FakeClient())
    queued = len(units) * 100
    assert sizing.units_per_task(queued) == 1  # nothing measured yet
    sizing.learn(seconds=0.5, units=5)  # 0.1 s per unit, 1 s per task wanted
    assert sizing.units_per_task(queued) == 10
    for _ in range(30):  # a moving average: faster units soon count
        sizing.learn(seconds=0.0001, units=1)
    assert sizing.units_per_task(queued) == MAX_UNITS_PER_TASK
    assert sizing.units_per_task(12) == 3  # near the end: a share per thread, at least 1
    assert sizing.in_flight() == 64  # the floor, with 2 threads


def _double(rows):
    return [{"id": r["id"], "double": 2 * r["id"]} for r in rows]


def test_a_run_started_before_any_worker_logs_no_error(make_cluster):
    """While a batch cluster's first jobs queue, each wave's scatter used to wait for a
    worker, fail on the scheduler and be logged there as an error with its traceback
    ("No valid workers found"); the rows then travelled inside the tasks anyway."""
    client = make_cluster(n_workers=0)
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append  # type: ignore[method-assign]
    loggers = [logging.getLogger(name) for name in ("distributed", "distributed.core")]
    for logger in loggers:
        logger.addHandler(handler)
    threading.Timer(2.5, client.cluster.scale, [1]).start()
    try:
        result = dask_pcm.run_batch(
            _double, [{"id": i} for i in range(40)], cluster=client, rows_per_unit=4,
            progress=False,
        )  # fmt: skip
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
    assert sorted(result.to_pandas()["double"]) == [2 * i for i in range(40)]
    assert [r.getMessage() for r in records] == []
