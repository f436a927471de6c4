"""The two plugins on an in-process cluster (distributed's gen_cluster): what a worker
reports is what the scheduler shows, joining workers, failures, and a clean uninstall."""

from __future__ import annotations

import asyncio
import time

import pytest
from distributed import Worker
from distributed.utils_test import gen_cluster

from dask_pcm import protocol
from dask_pcm.context import Context
from dask_pcm.exceptions import ContextLoadError
from dask_pcm.scheduler import ContextScheduler, get_plugin
from dask_pcm.tasks import ContextTask
from dask_pcm.worker import ContextPlugin, context_plugins, plugin_name


def _small(location: str) -> dict:
    return {"built from": location}


def _broken(location: str) -> dict:
    raise RuntimeError(f"CUDA out of memory while loading {location}")


def _uses(x: int) -> int:
    from dask_pcm.tasks import get_context

    return len(get_context("ctx")) + x


async def _install(c, s, loader) -> None:
    await c.register_plugin(ContextScheduler())
    get_plugin(s).declare("ctx", "full")
    plugin = ContextPlugin(Context("ctx", loader, template="nowhere"), "full")
    await c.register_plugin(plugin, name=plugin_name("ctx"))


async def _until(condition, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def _state(s, worker: str) -> str | None:
    placement = get_plugin(s).states.placements.get("ctx", {}).get(worker)
    return None if placement is None else placement.state


@gen_cluster(client=True, nthreads=[])
async def test_a_joining_worker_reports_its_record_which_the_scheduler_shows(c, s):
    await _install(c, s, _small)
    async with Worker(s.address, nthreads=1) as w:
        await _until(lambda: _state(s, w.address) == protocol.READY)
        (row,) = get_plugin(s).rows()
        record = context_plugins(w)["ctx"].record
        assert list(row) == list(protocol.COLUMNS)  # one schema, in order
        reported = {c: v for c, v in row.items() if c not in protocol.SCHEDULER_FIELDS}
        assert reported == record.report()
        assert (row["loads"], row["location"]) == (1, "nowhere")
        assert await c.submit(ContextTask(_uses, "ctx"), 1) == 2
        await _until(lambda: get_plugin(s).rows()[0]["tasks"] == 1)  # counted on the scheduler


@gen_cluster(client=True, nthreads=[])
async def test_a_joining_worker_that_fails_is_reported_and_its_tasks_err(c, s):
    await _install(c, s, _broken)
    async with Worker(s.address, nthreads=1) as w:
        await _until(lambda: _state(s, w.address) == protocol.FAILED)
        (row,) = get_plugin(s).rows()
        assert "CUDA out of memory while loading nowhere" in row["error"]
        with pytest.raises(ContextLoadError, match="failed on every worker"):
            await c.submit(ContextTask(_uses, "ctx"), 1)


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_the_scheduler_plugin_removes_every_handler_it_added(c, s, a):
    await c.register_plugin(ContextScheduler())
    ops = [
        protocol.CHUNK_PLAN_OP,
        protocol.CHUNK_HAVE_OP,
        protocol.KEEP_WORKERS_OP,
    ]
    assert all(op in s.handlers for op in ops) and protocol.STATE_OP in s.stream_handlers
    await get_plugin(s).close()  # what the scheduler calls as it closes
    assert [op for op in ops if op in s.handlers] == []
    assert protocol.STATE_OP not in s.stream_handlers
