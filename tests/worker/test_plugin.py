"""The two plugins on an in-process cluster (distributed's gen_cluster): what a worker
reports is what the scheduler shows, joining workers, failures, and a clean uninstall.

Tests wait on events, never for a fixed time: for what the scheduler knows of a context, on
the scheduler plugin's readiness waiter (woken by every report); for a task, on its result
or on an event the task sets.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from distributed import Worker, get_worker
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


async def _until(s, condition, seconds: float = 10) -> None:
    """Wait until ``condition()``, checked at every report the scheduler plugin receives."""
    assert await get_plugin(s).readiness.until(condition, seconds), "condition not met in time"


def _state(s, worker: str) -> str | None:
    placement = get_plugin(s).states.placements.get("ctx", {}).get(worker)
    return None if placement is None else placement.state


@gen_cluster(client=True, nthreads=[])
async def test_a_joining_worker_reports_its_record_which_the_scheduler_shows(c, s):
    await _install(c, s, _small)
    async with Worker(s.address, nthreads=1) as w:
        await _until(s, lambda: _state(s, w.address) == protocol.READY)
        (row,) = get_plugin(s).rows()
        record = context_plugins(w)["ctx"].record
        assert list(row) == list(protocol.COLUMNS)  # one schema, in order
        reported = {c: v for c, v in row.items() if c not in protocol.SCHEDULER_FIELDS}
        assert reported == record.report()
        assert (row["loads"], row["location"]) == (1, "nowhere")
        assert await c.submit(ContextTask(_uses, "ctx"), 1) == 2
        # Counted on the scheduler, as the task's result arrived there.
        assert get_plugin(s).rows()[0]["tasks"] == 1


@gen_cluster(client=True, nthreads=[])
async def test_a_joining_worker_that_fails_is_reported_and_its_tasks_err(c, s):
    await _install(c, s, _broken)
    async with Worker(s.address, nthreads=1) as w:
        await _until(s, lambda: _state(s, w.address) == protocol.FAILED)
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
        protocol.SETTLE_OP,
    ]
    assert all(op in s.handlers for op in ops) and protocol.STATE_OP in s.stream_handlers
    await get_plugin(s).close()  # what the scheduler calls as it closes
    assert [op for op in ops if op in s.handlers] == []
    assert protocol.STATE_OP not in s.stream_handlers


class _GPUContext:
    """What a loader built on a GPU it could use only partly: dtype, warning, batch size."""

    device = "cpu"
    dtype = "float16"
    warning = "GPU X (compute capability 6.1) is not supported by this torch"

    def __init__(self) -> None:
        self.batch_size = 64


def _on_gpu(location: str) -> _GPUContext:
    return _GPUContext()


def _runs_out_of_memory(x: int) -> int:
    from dask_pcm.tasks import get_context

    lm = get_context("ctx")
    lm.batch_size //= 2  # what LanguageModel does after an out-of-memory error
    return lm.batch_size


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_status_shows_dtype_warning_and_a_batch_size_that_shrank(c, s, a):
    await _install(c, s, _on_gpu)
    await _until(s, lambda: _state(s, a.address) == protocol.READY)
    (row,) = get_plugin(s).rows()
    assert (row["dtype"], row["batch_size"]) == ("float16", 64)
    assert "compute capability 6.1" in row["warning"]
    assert await c.submit(ContextTask(_runs_out_of_memory, "ctx"), 1) == 32
    await _until(s, lambda: get_plugin(s).rows()[0]["batch_size"] == 32)


RELEASED: list[str] = []


class _Releasing:
    def __call__(self, location: str) -> dict[str, bool]:
        return {"released": False}

    def release(self, value: dict[str, bool]) -> None:
        value["released"] = True
        RELEASED.append("released")


# Set (on the worker's event loop, which gen_cluster shares) once a task holds the context.
HOLDING: list[asyncio.Event] = []


def _uses_it_for(seconds: float) -> bool:
    """Hold the context for a while (the task's work); whether it was freed under it."""
    from dask_pcm.tasks import get_context

    context = get_context("ctx")
    get_worker().loop.add_callback(HOLDING[0].set)
    time.sleep(seconds)
    return context["released"]


async def _running_with_the_context(c, s, a, seconds: float):
    RELEASED.clear()
    HOLDING[:] = [asyncio.Event()]
    await _install(c, s, _Releasing())
    future = c.submit(ContextTask(_uses_it_for, "ctx"), seconds, pure=False)
    await asyncio.wait_for(HOLDING[0].wait(), 10)
    assert context_plugins(a)["ctx"].holder.active == 1
    return future


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_unregister_waits_for_the_running_task_before_freeing(c, s, a):
    # Freed under a running forward pass (weights moved to the meta device), the task failed.
    future = await _running_with_the_context(c, s, a, 0.5)
    await c.unregister_worker_plugin(plugin_name("ctx"))
    assert RELEASED == ["released"]  # freed once unregister returns...
    assert await future is False  # ... but not under the task


@gen_cluster(client=True, nthreads=[("", 1)], config={"pcm.worker.release-timeout": "100ms"})
async def test_a_task_outlasting_the_release_timeout_frees_the_context_itself(c, s, a):
    future = await _running_with_the_context(c, s, a, 1.0)
    await c.unregister_worker_plugin(plugin_name("ctx"))
    assert RELEASED == []  # unregister gave up waiting; the task still uses the context
    assert await future is False
    assert RELEASED == ["released"]  # freed by the task as it let the context go
