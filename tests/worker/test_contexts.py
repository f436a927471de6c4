"""The context mechanism on a 2-worker in-process LocalCluster with the tiny model."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import dask
import pytest
from distributed import Client, get_worker

import dask_pcm
from dask_pcm import ContextLoadError, ContextNotFoundError, ContextTimeoutError
from dask_pcm.engine.model import building_for_one_task
from dask_pcm.templates.sources import resolve_source, template_files
from tests.conftest import cluster_client

# Loaders and tasks live at module level so that they pickle by reference.


def _score(prompt: str) -> tuple[str, int]:
    lm = dask_pcm.get_context("tiny")
    logits = lm.next_token_logits([prompt])
    return get_worker().address, int(logits.argmax(-1)[0])


@pytest.fixture
def cluster(inproc_cluster):
    return inproc_cluster


def _rows(client: Client, name: str):
    table = dask_pcm.status(client, [name])
    return {row.worker: row for row in table.itertuples()}


def test_full_loads_once_per_worker_and_serves_every_task(cluster, tiny_model_dir):
    _, client = cluster
    table = dask_pcm.register(client, dask_pcm.causal_lm(tiny_model_dir, name="tiny", level="full"))
    assert list(table["state"]) == ["ready", "ready"]
    prompts = [f"claim number {i} is true" for i in range(100)]
    results = client.gather(dask_pcm.map(client, _score, prompts, context="tiny"))
    assert len(results) == 100
    rows = _rows(client, "tiny")
    assert set(rows) == set(client.scheduler_info()["workers"])
    assert all(r.loads == 1 for r in rows.values())
    assert sum(r.tasks for r in rows.values()) == 100
    served = {addr for addr, _ in results}
    assert served <= set(rows)
    assert all(r.device.startswith("cpu (") and r.level == "full" for r in rows.values())
    assert all(r.batch_size == 8 for r in rows.values())  # chosen for the CPU at load


def test_agnostic_loads_once_per_task(cluster, tiny_model_dir):
    _, client = cluster
    dask_pcm.register(client, dask_pcm.causal_lm(tiny_model_dir, name="tiny"), level="agnostic")
    client.gather(dask_pcm.map(client, _score, [f"p{i}" for i in range(12)], context="tiny"))
    rows = _rows(client, "tiny")
    assert sum(r.tasks for r in rows.values()) == 12
    for r in rows.values():
        assert r.loads == r.tasks
        assert r.location == str(tiny_model_dir)  # read from the source every time
        assert r.level == "agnostic"


def test_agnostic_reads_the_source_through_the_simulated_shared_fs(cluster, tiny_model_dir):
    from dask_pcm.templates.throttle import SharedBandwidth

    _, client = cluster
    nbytes = sum(f.stat().st_size for f in template_files(resolve_source(tiny_model_dir)))
    dask_pcm.register(client, dask_pcm.causal_lm(tiny_model_dir, name="tiny"), level="agnostic")
    SharedBandwidth(1, name="template-source").reset()
    # One read of the template takes 0.2 s on the host's link; six tasks read it six times.
    with dask.config.set({"pcm.template.source-bandwidth": int(nbytes / 0.2)}):
        client.gather(dask_pcm.map(client, _score, [f"p{i}" for i in range(6)], context="tiny"))
    rows = _rows(client, "tiny")
    assert sum(r.tasks for r in rows.values()) == 6
    assert sum(r.bytes_from_source for r in rows.values()) == 6 * nbytes
    # Reads share one link: together they waited at least their six slots of 0.2 s.
    assert sum(r.fetch_seconds for r in rows.values()) >= 6 * 0.2 - 0.05


def test_partial_copies_template_once_and_loads_per_task(cluster, tiny_model_dir):
    _, client = cluster
    dask_pcm.register(client, dask_pcm.causal_lm(tiny_model_dir, name="tiny", level="partial"))
    client.gather(dask_pcm.map(client, _score, [f"p{i}" for i in range(12)], context="tiny"))
    rows = _rows(client, "tiny")
    assert sum(r.tasks for r in rows.values()) == 12
    files = template_files(resolve_source(tiny_model_dir))
    source_bytes = sum(p.stat().st_size for p in files)
    locations = set()
    for r in rows.values():
        assert r.loads == r.tasks
        local = Path(r.location)
        assert local != Path(tiny_model_dir) and local.is_dir()
        assert sorted(p.name for p in template_files(resolve_source(local))) == sorted(
            p.name for p in files
        )
        assert r.template_bytes == source_bytes
        locations.add(local)
    assert len(locations) == 2  # one worker-local copy each


def test_same_results_at_every_level(tiny_model_dir):
    prompts = [f"the sky is colour {i}" for i in range(6)]
    answers = {}
    with cluster_client() as client:
        for level in ("full", "partial", "agnostic"):
            ctx = dask_pcm.causal_lm(tiny_model_dir, name="tiny", level=level)
            dask_pcm.register(client, ctx)
            futs = dask_pcm.map(client, _score, prompts, context="tiny", pure=False)
            answers[level] = [token for _, token in client.gather(futs)]
            dask_pcm.unregister(client, "tiny")
    assert answers["full"] == answers["partial"] == answers["agnostic"]


def _one_task_flag(location: str) -> dict[str, bool]:
    return {"one_task": building_for_one_task()}


def _flag(_: int) -> bool:
    return dask_pcm.get_context("flag")["one_task"]


def test_per_task_levels_build_for_one_task_and_full_for_many(tiny_model_dir):
    # What lets a loader skip work that pays off only over many tasks (CausalLM's warm-up
    # pass on a CPU): at agnostic and partial the object serves one task, at full every task.
    seen = {}
    with cluster_client() as client:
        for level in ("full", "partial", "agnostic"):
            ctx = dask_pcm.Context("flag", _one_task_flag, template=str(tiny_model_dir))
            dask_pcm.register(client, ctx, level=level)
            seen[level] = set(client.gather(dask_pcm.map(client, _flag, range(3), context="flag")))
            dask_pcm.unregister(client, "flag")
    assert seen == {"full": {False}, "partial": {True}, "agnostic": {True}}


class SlowLoader:
    """Sleeps, then returns when it was built; fails where a marker file exists."""

    def __init__(self, seconds: float, fail_if: str | None = None) -> None:
        self.seconds = seconds
        self.fail_if = fail_if

    def __call__(self, location: str) -> dict[str, float]:
        if self.fail_if and Path(self.fail_if).exists():
            raise OSError(f"cannot read model weights at {location}: disk quota exceeded")
        time.sleep(self.seconds)
        return {"built_at": time.time()}


def _built_at() -> tuple[str, float, float]:
    return get_worker().address, dask_pcm.get_context("slow")["built_at"], time.time()


def test_joining_worker_materialises_before_running_context_tasks(cluster):
    lc, client = cluster
    dask_pcm.register(client, dask_pcm.Context("slow", SlowLoader(1.0), template="x"))
    before = set(client.scheduler_info()["workers"])
    lc.scale(3)
    client.wait_for_workers(3)
    (new,) = set(client.scheduler_info()["workers"]) - before
    addr, built_at, ran_at = client.submit(
        dask_pcm.uses_context("slow")(_built_at), workers=[new], pure=False
    ).result(timeout=30)
    assert addr == new and ran_at >= built_at
    row = _rows(client, "slow")[new]
    assert (row.state, row.loads, row.tasks) == ("ready", 1, 1)
    assert row.load_seconds >= 1.0


def _boom(location: str) -> None:
    raise FileNotFoundError(f"no model at {location}")


def test_failing_loader_raises_in_register_with_every_worker(cluster):
    _, client = cluster
    start = time.perf_counter()
    with pytest.raises(ContextLoadError) as info:
        dask_pcm.register(client, dask_pcm.Context("bad", _boom, template="/no/such/model"))
    assert time.perf_counter() - start < 10
    workers = set(client.scheduler_info()["workers"])
    assert set(info.value.failures) == workers
    message = str(info.value)
    for w in workers:
        assert w in message
    assert "no model at /no/such/model" in message
    assert "unregistered" in message
    assert dask_pcm.registered_contexts(client) == []
    # Work for it fails at once instead of waiting for a context that will never exist.
    fut = dask_pcm.submit(client, _built_at, context="bad")
    with pytest.raises(ContextNotFoundError, match="not registered"):
        fut.result(timeout=10)


def test_joining_worker_that_fails_is_reported_and_its_tasks_fail_fast(cluster, tmp_path):
    lc, client = cluster
    marker = tmp_path / "broken"
    dask_pcm.register(client, dask_pcm.Context("slow", SlowLoader(0, fail_if=str(marker))))
    marker.touch()
    before = set(client.scheduler_info()["workers"])
    lc.scale(3)
    client.wait_for_workers(3)
    (new,) = set(client.scheduler_info()["workers"]) - before
    fut = dask_pcm.submit(client, _built_at, context="slow", workers=[new], pure=False)
    with pytest.raises(ContextLoadError, match="disk quota exceeded") as info:
        fut.result(timeout=10)
    assert new in str(info.value)
    rows = _rows(client, "slow")
    assert rows[new].state == "failed" and "disk quota exceeded" in rows[new].error
    assert all(rows[w].state == "ready" for w in before)
    # The healthy workers keep serving.
    assert client.submit(dask_pcm.uses_context("slow")(_built_at), pure=False).result(10)


def test_ready_timeout_fails_the_task_not_hangs(cluster):
    _, client = cluster
    dask_pcm.register(client, dask_pcm.Context("slow", SlowLoader(0.0)))
    with dask.config.set({"pcm.worker.ready-timeout": "0.2s"}):
        # Re-register with a slow loader: the plugin is replaced and loads again.
        client.register_plugin(
            dask_pcm.worker.ContextPlugin(dask_pcm.Context("slow", SlowLoader(3.0)), "full"),
            name=dask_pcm.worker.plugin_name("slow"),
        )
        # Steered: the task waits on the scheduler, which gives up on the stuck loads.
        fut = dask_pcm.submit(client, _built_at, context="slow", pure=False)
        with pytest.raises(ContextTimeoutError, match=r"not ready on any worker after 0\.2 s"):
            fut.result(timeout=10)
        # Loose placement sends it to a worker still loading: the worker's wait times out.
        fut = dask_pcm.submit(
            client, _built_at, context="slow", pure=False, allow_other_workers=True
        )
        with pytest.raises(ContextTimeoutError, match="not ready on worker"):
            fut.result(timeout=10)


RELEASED: list[str] = []


RELEASING_THREADS: list[str] = []


class ReleasingLoader:
    def __call__(self, location: str) -> dict[str, str]:
        return {"location": location}

    def release(self, value: dict[str, str]) -> None:
        RELEASED.append(value["location"])
        RELEASING_THREADS.append(threading.current_thread().name)


def test_unregister_frees_the_context_on_every_worker(cluster):
    _, client = cluster
    RELEASED.clear()
    dask_pcm.register(client, dask_pcm.Context("rel", ReleasingLoader(), template="here"))
    assert dask_pcm.registered_contexts(client) == ["rel"]
    dask_pcm.unregister(client, "rel")
    assert RELEASED == ["here", "here"]
    assert dask_pcm.status(client).empty
    assert dask_pcm.registered_contexts(client) == []
    with pytest.raises(ContextNotFoundError, match="rel"):
        dask_pcm.unregister(client, "rel")


class LoaderWithAReleaseFile:
    """A loader whose attribute ``release`` is data (a path), not a method."""

    def __init__(self) -> None:
        self.release = "/tmp/release-marker"

    def __call__(self, location: str) -> dict[str, str]:
        return {"location": location}


def test_a_loader_attribute_named_release_that_is_not_callable_is_left_alone(cluster, caplog):
    _, client = cluster
    dask_pcm.register(client, dask_pcm.Context("attr", LoaderWithAReleaseFile(), template="t"))
    with caplog.at_level("ERROR"):
        dask_pcm.unregister(client, "attr")
    assert "not callable" not in caplog.text
    assert dask_pcm.status(client).empty


def test_closing_worker_frees_its_context_before_close_returns():
    # A release left to a background thread could still be inside torch when the worker's
    # process exits, which aborted it ("terminate called without an active exception").
    RELEASED.clear()
    RELEASING_THREADS.clear()
    with cluster_client(n_workers=2) as client:
        dask_pcm.register(client, dask_pcm.Context("rel", ReleasingLoader(), template="there"))
    assert RELEASED == ["there", "there"]
    assert not any("_release" in name for name in RELEASING_THREADS), RELEASING_THREADS


def test_decorator_works_with_plain_submit_and_delayed(cluster):
    _, client = cluster
    dask_pcm.register(client, dask_pcm.Context("rel", ReleasingLoader(), template="t"))

    @dask_pcm.uses_context("rel")
    def where(suffix: str) -> str:
        return dask_pcm.get_context("rel")["location"] + suffix

    assert client.submit(where, "!").result() == "t!"
    assert dask.delayed(where)("?").compute() == "t?"
    assert dask_pcm.status(client)["tasks"].sum() == 2


def test_get_context_outside_a_worker_is_a_clear_error():
    with pytest.raises(ContextNotFoundError, match="outside a Dask worker"):
        dask_pcm.get_context("anything")


def test_bad_declarations_are_rejected():
    with pytest.raises(ValueError, match="invalid context name"):
        dask_pcm.Context("has space", _boom)
    with pytest.raises(ValueError, match="unknown context level 'hot'"):
        dask_pcm.Context("ok", _boom, level="hot")
    with pytest.raises(TypeError, match="loader must be callable"):
        dask_pcm.Context("ok", "not callable")  # type: ignore[arg-type]


def test_config_namespace_and_environment_override(monkeypatch):
    assert dask.config.get("pcm.worker.load-concurrency") == 1
    assert dask.config.get("pcm.default-level") == "full"
    monkeypatch.setenv("DASK_PCM__WORKER__LOAD_CONCURRENCY", "3")
    monkeypatch.setenv("DASK_PCM__DEFAULT_LEVEL", "partial")
    try:
        dask.config.refresh()
        assert dask_pcm.config.get("worker.load-concurrency") == 3
        assert dask_pcm.config.default_level() == "partial"
    finally:
        monkeypatch.undo()
        dask.config.refresh()
    assert dask_pcm.config.default_level() == "full"
    with dask.config.set({"pcm.default-level": "agnostic"}):
        assert dask_pcm.config.default_level() == "agnostic"


def test_host_slots_bound_concurrency():
    from dask_pcm.locks import host_slot

    active, peak, lock = [0], [0], threading.Lock()

    def work():
        with host_slot("test-slots", 2):
            with lock:
                active[0] += 1
                peak[0] = max(peak[0], active[0])
            time.sleep(0.1)
            with lock:
                active[0] -= 1

    threads = [threading.Thread(target=work) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert peak[0] == 2


def test_a_cpu_only_host_builds_two_contexts_at_once(monkeypatch, tmp_path):
    """Two CPU loads from local copies take no turns (the second worker waited a whole
    load before); a worker that sees a GPU, or a build reading the source, takes the slot."""
    import fcntl

    from dask_pcm.worker import plugin

    monkeypatch.setattr(plugin, "visible_gpus", lambda: [])
    both_in = threading.Barrier(2, timeout=30)

    def load() -> None:
        with plugin.load_slot(reads_source=False):
            both_in.wait()  # broken (an error) if one load waited for the other

    with dask.config.set({"pcm.lock-directory": str(tmp_path)}):
        threads = [threading.Thread(target=load) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not both_in.broken

        for gpus, reads_source in ((["0"], False), ([], True)):
            monkeypatch.setattr(plugin, "visible_gpus", lambda gpus=gpus: gpus)
            with plugin.load_slot(reads_source=reads_source):
                fd = os.open(tmp_path / "context-load.0.lock", os.O_RDWR)
                try:
                    with pytest.raises(BlockingIOError):  # held: the next load waits
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                finally:
                    os.close(fd)


def test_registering_the_same_context_again_keeps_it_resident(cluster):
    _, client = cluster
    RELEASED.clear()
    ctx = dask_pcm.Context("rel", ReleasingLoader(), template="keep")
    dask_pcm.register(client, ctx)
    dask_pcm.register(client, ctx)  # e.g. a notebook cell run twice
    assert RELEASED == []
    assert list(dask_pcm.status(client)["loads"]) == [1, 1]
    dask_pcm.register(client, ctx, reload=True)
    assert RELEASED == ["keep", "keep"]  # the old copies were freed
    changed = dask_pcm.Context("rel", ReleasingLoader(), template="other")
    dask_pcm.register(client, changed)  # same name, other template: replaced
    assert sorted(RELEASED) == ["keep"] * 4
    assert set(dask_pcm.status(client)["location"]) == {"other"}


def test_register_gives_up_on_a_load_that_never_finishes(cluster):
    _, client = cluster
    start = time.perf_counter()
    with pytest.raises(ContextLoadError, match="not ready on worker") as info:
        dask_pcm.register(client, dask_pcm.Context("stuck", SlowLoader(2.0)), timeout=0.3)
    assert time.perf_counter() - start < 10
    assert len(info.value.failures) == 2
    assert dask_pcm.registered_contexts(client) == []
