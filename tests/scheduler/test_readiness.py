"""The scheduler's wait for contexts to settle (``Readiness.settle``, the ``pcm_settle``
handler) on an in-process cluster (distributed's gen_cluster): it answers when every
present worker has the context ready or failed, when one has it ready (``first``), or at
its timeout naming what is still loading; a context failed everywhere is unregistered.

Loaders wait on events that the test sets, never for a fixed time."""

from __future__ import annotations

import threading

from distributed.utils_test import gen_cluster

from dask_pcm import protocol
from dask_pcm.context import Context
from dask_pcm.scheduler import ContextScheduler, get_plugin
from dask_pcm.worker import ContextPlugin, plugin_name

#: Set by a test to let the slow loader finish (the loader runs in a worker thread).
RELEASE = threading.Event()


def _quick(location: str) -> str:
    return "built"


def _slow(location: str) -> str:
    RELEASE.wait(30)
    return "built late"


_CALLS = []
_CALLS_LOCK = threading.Lock()


def _first_quick(location: str) -> str:
    """Quick on the first worker that loads it, slow on the others."""
    with _CALLS_LOCK:
        _CALLS.append(location)
        first = len(_CALLS) == 1
    return "built" if first else _slow(location)


def _broken(location: str) -> str:
    raise RuntimeError(f"no such file under {location}")


async def _declare(c, s, name: str, loader) -> None:
    get_plugin(s).declare(name, "full")
    plugin = ContextPlugin(Context(name, loader, template="nowhere"), "full")
    await c.register_plugin(plugin, name=plugin_name(name))


@gen_cluster(client=True, nthreads=[("", 1), ("", 1)])
async def test_it_answers_once_every_present_worker_has_the_context_ready(c, s, a, b):
    await c.register_plugin(ContextScheduler())
    await _declare(c, s, "ctx", _quick)
    answer = await get_plugin(s).readiness.settle(["ctx"], timeout=20)
    assert answer["workers"] == sorted([a.address, b.address])
    assert answer["failures"] == {} and answer["unregistered"] == []
    assert {r["state"] for r in answer["rows"]} == {protocol.READY}


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_at_its_timeout_it_names_the_context_and_worker_still_loading(c, s, a):
    RELEASE.clear()
    await c.register_plugin(ContextScheduler())
    await _declare(c, s, "slow", _slow)
    try:
        answer = await get_plugin(s).readiness.settle(["slow"], timeout=0.5)
    finally:
        RELEASE.set()
    (why,) = answer["failures"]["slow"].values()
    assert f"'slow' not ready on worker {a.address} after 0.5 s" in why
    assert answer["unregistered"] == ["slow"]  # not ready on the only worker it waited for


@gen_cluster(client=True, nthreads=[("", 1), ("", 1)])
async def test_a_context_failed_on_every_worker_is_unregistered_with_the_loaders_error(c, s, a, b):
    await c.register_plugin(ContextScheduler())
    await _declare(c, s, "bad", _broken)
    answer = await get_plugin(s).readiness.settle(["bad"], timeout=20)
    assert answer["unregistered"] == ["bad"]
    assert set(answer["failures"]["bad"]) == {a.address, b.address}
    assert all("no such file under nowhere" in w for w in answer["failures"]["bad"].values())
    assert "bad" not in get_plugin(s).states.levels


@gen_cluster(client=True, nthreads=[("", 1), ("", 1)])
async def test_first_answers_at_the_first_ready_worker_without_failures_for_the_others(c, s, a, b):
    RELEASE.clear()
    _CALLS.clear()
    await c.register_plugin(ContextScheduler())
    await _declare(c, s, "ctx", _first_quick)
    try:
        answer = await get_plugin(s).readiness.settle(["ctx"], timeout=20, first=True)
        states = sorted(r["state"] for r in answer["rows"])
    finally:
        RELEASE.set()
    assert answer["failures"] == {} and answer["unregistered"] == []
    assert states[-1] == protocol.READY and protocol.READY not in states[:-1]  # one ready
