"""dask_pcm.register on an in-process cluster: what it asks of the scheduler (two calls at
most), idempotence, workers that join later or are not there yet, and its errors."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from distributed import Client, LocalCluster
from distributed.core import PooledRPCCall
from distributed.utils_test import gen_cluster

import dask_pcm
from dask_pcm import ContextLoadError, protocol
from dask_pcm.deploy.preemption import NAME as PREEMPTION
from dask_pcm.scheduler import ContextScheduler, get_plugin
from tests.conftest import cluster_client

# Loaders live at module level so that they pickle by reference; the workers are threads of
# this process, so they append to these lists.
LOADS: list[str | None] = []
_FLAKY = threading.Lock()


def _counting(location: str | None) -> dict:
    LOADS.append(location)
    return {"built from": location}


def _fails_first(location: str | None) -> dict:
    with _FLAKY:
        LOADS.append(location)
        if len(LOADS) == 1:
            raise RuntimeError(f"CUDA out of memory while loading {location}")
    return {"built from": location}


def _boom(location: str | None) -> dict:
    raise FileNotFoundError(f"no model at {location}")


@pytest.fixture(autouse=True)
def _no_loads() -> Iterator[None]:
    LOADS.clear()
    yield
    LOADS.clear()


@contextmanager
def _cluster(workers: int) -> Iterator[tuple[LocalCluster, Client]]:
    # The client refreshes its scheduler info every 2 s (an rpc call of its own): not here.
    config = {"distributed.client.scheduler-info-interval": "1h"}
    with cluster_client(workers, config=config) as client:
        yield client.cluster, client


@pytest.fixture
def cluster() -> Iterator[tuple[LocalCluster, Client]]:
    """Two in-process workers, no scheduler preload: register installs the scheduler plugin."""
    with _cluster(2) as both:
        yield both


@contextmanager
def scheduler_calls(client: Client) -> Iterator[Counter[str]]:
    """Counts what ``client`` asks of its scheduler while the block runs: every rpc call
    (``client.scheduler.<op>(...)``: distributed's PooledRPCCall makes each op through
    ``__getattr__``, one round trip per call) and every message on its batched stream."""
    calls: Counter[str] = Counter()
    rpc_getattr = PooledRPCCall.__getattr__
    send = Client._send_to_scheduler

    def counting_getattr(self: PooledRPCCall, key: str) -> Any:
        if self is client.scheduler:
            calls[key] += 1
        return rpc_getattr(self, key)

    def counting_send(self: Client, msg: dict) -> None:
        if self is client:
            calls[f"stream:{msg.get('op')}"] += 1
        send(self, msg)

    PooledRPCCall.__getattr__ = counting_getattr
    Client._send_to_scheduler = counting_send
    try:
        yield calls
    finally:
        PooledRPCCall.__getattr__ = rpc_getattr
        Client._send_to_scheduler = send


def _context_plugins(dask_worker: Any) -> list[str]:
    return sorted(n for n in dask_worker.plugins if n.startswith(protocol.PLUGIN_PREFIX))


def _has_preemption_plugin(dask_worker: Any) -> bool:
    return PREEMPTION in dask_worker.plugins


def _scheduler_context_plugins(dask_scheduler: Any) -> list[str]:
    return sorted(n for n in dask_scheduler.worker_plugins if n.startswith(protocol.PLUGIN_PREFIX))


def test_register_asks_the_scheduler_twice_at_most(cluster):
    _, client = cluster
    ctx = dask_pcm.Context("counted", _counting)
    with scheduler_calls(client) as calls:
        table = dask_pcm.register(client, ctx)
    assert sum(calls.values()) <= 2, dict(calls)
    assert list(table["state"]) == ["ready", "ready"]  # answered once both were ready
    with scheduler_calls(client) as calls:
        dask_pcm.register(client, ctx)  # nothing to do
    assert sum(calls.values()) <= 2, dict(calls)
    with scheduler_calls(client) as calls, pytest.raises(ContextLoadError):
        dask_pcm.register(client, dask_pcm.Context("bad", _boom))
    assert sum(calls.values()) <= 2, dict(calls)  # the unregistering included


def test_registering_again_keeps_one_plugin_and_the_built_copies(cluster):
    _, client = cluster
    ctx = dask_pcm.Context("counted", _counting, template="first")
    dask_pcm.register(client, ctx)
    again = dask_pcm.register(client, dask_pcm.Context("counted", _counting, template="first"))
    assert LOADS == ["first", "first"]  # one build per worker, none again
    assert list(again["loads"]) == [1, 1]
    assert client.run_on_scheduler(_scheduler_context_plugins) == ["dask-pcm-context-counted"]
    assert set(map(tuple, client.run(_context_plugins).values())) == {("dask-pcm-context-counted",)}
    # The core registers no preemption plugin: a batch cluster's jobs install it themselves.
    assert set(client.run(_has_preemption_plugin).values()) == {False}

    table = dask_pcm.register(client, ctx, reload=True)
    assert LOADS == ["first"] * 4
    assert list(table["state"]) == ["ready", "ready"] and list(table["loads"]) == [1, 1]
    changed = dask_pcm.register(client, dask_pcm.Context("counted", _counting, template="second"))
    assert LOADS == ["first"] * 4 + ["second"] * 2  # same name, other template: replaced
    assert set(changed["location"]) == {"second"} and set(changed["state"]) == {"ready"}
    assert client.run_on_scheduler(_scheduler_context_plugins) == ["dask-pcm-context-counted"]


def test_a_worker_that_joins_later_builds_the_context(cluster):
    lc, client = cluster
    ctx = dask_pcm.Context("counted", _counting)
    dask_pcm.register(client, ctx)
    lc.scale(3)
    client.wait_for_workers(3)
    # Registering it again waits for the newcomer, and reloads nothing elsewhere.
    table = dask_pcm.register(client, ctx)
    assert list(table["state"]) == ["ready"] * 3
    assert list(table["loads"]) == [1, 1, 1]
    assert len(LOADS) == 3


def test_with_no_worker_register_returns_at_once_and_workers_build_it_as_they_come():
    with _cluster(0) as (lc, client):
        ctx = dask_pcm.Context("counted", _counting)
        table = dask_pcm.register(client, ctx)
        assert table.empty and list(table.columns) == list(protocol.COLUMNS)
        assert dask_pcm.registered_contexts(client) == ["counted"]
        lc.scale(1)
        client.wait_for_workers(1)
        assert list(dask_pcm.register(client, ctx)["state"]) == ["ready"]
        assert LOADS == [None]


def test_a_loader_that_fails_on_one_worker_is_named_and_the_context_stays(cluster):
    _, client = cluster
    with pytest.raises(ContextLoadError) as info:
        dask_pcm.register(client, dask_pcm.Context("flaky", _fails_first, template="/models/x"))
    (failed,) = info.value.failures
    assert str(info.value) == (
        "context 'flaky' failed on 1 of 2 worker(s):\n"
        f"  {failed}: RuntimeError: CUDA out of memory while loading /models/x "
        "(building from '/models/x')"
    )
    assert dask_pcm.registered_contexts(client) == ["flaky"]  # ready on the other worker
    table = dask_pcm.status(client, ["flaky"])
    assert dict(zip(table["worker"], table["state"], strict=True))[failed] == "failed"
    assert sorted(table["state"]) == ["failed", "ready"]


def test_a_loader_that_fails_everywhere_names_every_worker_and_is_unregistered(cluster):
    _, client = cluster
    with pytest.raises(ContextLoadError) as info:
        dask_pcm.register(client, dask_pcm.Context("bad", _boom, template="/no/such/model"))
    workers = sorted(client.scheduler_info()["workers"])
    assert sorted(info.value.failures) == workers
    lines = str(info.value).splitlines()
    assert lines[0] == "context 'bad' failed on 2 of 2 worker(s) and was unregistered:"
    for line, worker in zip(lines[1:], workers, strict=True):
        assert line.startswith(f"  {worker}: FileNotFoundError: no model at /no/such/model")
    assert dask_pcm.registered_contexts(client) == []


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_the_wait_wakes_on_a_report_and_ignores_the_replaced_plugins(c, s, a):
    await c.register_plugin(ContextScheduler())
    plugin = get_plugin(s)
    plugin.declare("ctx", "full", token="one", registration="old")
    plugin.on_state(a.address, "ctx", protocol.READY, 1, registration="old")
    assert [r["state"] for r in plugin.rows()] == [protocol.READY]
    plugin.declare("ctx", "full", token="two", registration="new")  # e.g. reload=True
    assert [r["state"] for r in plugin.rows()] == [protocol.ABSENT]
    settle = asyncio.ensure_future(plugin.readiness.settle(["ctx"], timeout=30))
    await asyncio.sleep(0)  # it runs up to its wait
    # A late "ready" of the plugin the new registration replaced does not count.
    plugin.on_state(a.address, "ctx", protocol.READY, 2, registration="old")
    await asyncio.sleep(0)
    assert not settle.done()
    plugin.on_state(a.address, "ctx", protocol.READY, 3, registration="new")
    answer = await asyncio.wait_for(settle, 5)
    assert answer["failures"] == {} and answer["workers"] == [a.address]
    assert [r["state"] for r in answer["rows"]] == [protocol.READY]
