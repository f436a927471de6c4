"""Peer-to-peer template transfer between in-process workers: peers, corruption, failures."""

from __future__ import annotations

import contextlib
import shutil
import time
from pathlib import Path

import dask
import pytest
from distributed import Client

from dask_pcm.exceptions import TemplateFetchError
from dask_pcm.templates.fetch import SourcePlanner, fetch
from dask_pcm.templates.manifest import Manifest, build_manifest
from dask_pcm.templates.serve import TemplateStore
from dask_pcm.testing import SharedBandwidth, StaticPeers, ThrottledReader
from tests.conftest import cluster_client

KIB = 1024


@pytest.fixture
def template(tiny_model_dir: Path, tmp_path: Path):
    with dask.config.set({"pcm.cache-directory": str(tmp_path / "cache")}):
        manifest, root = build_manifest(tiny_model_dir, 32 * KIB)
    return manifest, root


def _hold(manifest_json: str, root: str, dask_worker=None) -> None:
    TemplateStore.of(dask_worker).add(root, Manifest.from_json(manifest_json))


async def _fetch(manifest_json, dest, peers, source, dask_worker=None):
    """Copy the template on this worker from ``peers`` (a fixed plan), else ``source``."""
    manifest = Manifest.from_json(manifest_json)
    planner = StaticPeers(peers)
    path, report = await fetch(dask_worker, manifest, dest, source, planner=planner)
    kept = TemplateStore.of(dask_worker).reports[manifest.digest]
    assert kept is report  # what the worker's last copy of the template did
    return str(path), {**report.as_dict(), "timeline": report.timeline}


def _holder_and_joiner(client: Client, manifest: Manifest, root: Path, wrap=None):
    """The first worker holds the template (its handler wrapped by ``wrap(serve)``)."""
    holder, joiner = _workers(client)
    client.run(_hold, manifest.to_json(), str(root), workers=[holder])
    if wrap is not None:

        def install(dask_worker=None):
            handler = wrap(TemplateStore.of(dask_worker).serve)
            dask_worker.handlers["pcm_template_chunk"] = handler

        client.run(install, workers=[holder])
    return holder, joiner


def _fetch_on(client: Client, joiner: str, manifest: Manifest, dest, peers, source):
    path, report = client.run(
        _fetch, manifest.to_json(), str(dest), peers, source, workers=[joiner]
    )[joiner]
    return Path(path), report


def _workers(client: Client) -> list[str]:
    return sorted(client.scheduler_info()["workers"])


def _same_files(manifest: Manifest, a: Path, b: Path) -> None:
    for entry in manifest.files:
        assert (Path(a) / entry.path).read_bytes() == (Path(b) / entry.path).read_bytes()


@contextlib.contextmanager
def _one_holder(model: Path, tmp_path: Path, processes: bool = False, settings=None):
    """A one-worker cluster whose worker holds ``model``'s template (context ``tiny`` ready),
    in 16 KiB chunks; yields ``(cluster, client, holder)``."""
    from distributed import LocalCluster

    import dask_pcm

    config = {
        "pcm.cache-directory": str(tmp_path / "cache"),
        "pcm.template.chunk-size": "16 KiB",
        **(settings or {}),
    }
    with (
        dask.config.set(config),
        LocalCluster(
            n_workers=1, threads_per_worker=1, processes=processes, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
    ):
        dask_pcm.register(client, dask_pcm.causal_lm(model, name="tiny", device="cpu"))
        (holder,) = _workers(client)
        yield cluster, client, holder


def _add_joiner(cluster, client: Client, holder: str) -> str:
    """Start a second worker; its address."""
    cluster.scale(2)
    client.wait_for_workers(2, timeout=60)
    (joiner,) = set(_workers(client)) - {holder}
    return joiner


def _wait_ready(client: Client, worker: str, seconds: float):
    """The status row of ``worker`` once its context is ready; fails past ``seconds``."""
    import dask_pcm

    deadline = time.monotonic() + seconds
    while True:
        rows = dask_pcm.status(client).set_index("worker")
        if worker in rows.index:
            row = rows.loc[worker]
            assert row["state"] != "failed", row["error"]
            if row["state"] == "ready":
                return row
        assert time.monotonic() < deadline, f"{worker} not ready after {seconds} s"
        time.sleep(0.1)


def test_a_joiner_gets_the_template_from_a_peer(inproc_cluster, template, tmp_path):
    _, client = inproc_cluster
    manifest, root = template
    holder, joiner = _holder_and_joiner(client, manifest, root)
    path, report = _fetch_on(client, joiner, manifest, tmp_path / "joiner-copy", [holder], None)
    assert report["bytes_from_peers"] == manifest.total_bytes
    assert report["bytes_from_source"] == 0
    _same_files(manifest, root, path)


def test_a_corrupted_chunk_is_discarded_and_fetched_again(inproc_cluster, template, tmp_path):
    _, client = inproc_cluster
    manifest, root = template

    def corrupt_first(serve):
        left = [1]

        async def bad(digest, index):
            served = await serve(digest, index)  # a Serialize wrapper around an array
            if left[0]:
                left[0] -= 1
                data = bytes(served.data)
                return bytes([data[0] ^ 0xFF]) + data[1:]
            return served

        return bad

    holder, joiner = _holder_and_joiner(client, manifest, root, corrupt_first)
    path, report = _fetch_on(client, joiner, manifest, tmp_path / "copy", [holder], None)
    assert report["corrupted"] == 1
    assert report["failed_peers"] == []  # one bad chunk is a strike, not yet a drop
    assert report["bytes_from_peers"] == manifest.total_bytes
    _same_files(manifest, root, path)


def _damage(path: Path, offsets: list[int], nbytes: int = 100) -> None:
    """Zero ``nbytes`` at each offset of ``path``, in place (a damaged disk copy)."""
    with open(path, "r+b") as f:
        for offset in offsets:
            f.seek(offset)
            f.write(bytes(nbytes))


def test_a_peer_holding_a_corrupted_copy_is_dropped_and_the_source_finishes(
    inproc_cluster, template, tmp_path
):
    """The holder's copy on disk has three damaged chunks: after two the joiner drops it and
    reads the rest it lacks from the source, instead of asking it again forever."""
    _, client = inproc_cluster
    manifest, root = template
    damaged = Path(shutil.copytree(root, tmp_path / "holder-copy"))
    weights = damaged / "model.safetensors"
    _damage(weights, [40 * KIB, 200 * KIB, 400 * KIB])
    holder, joiner = _holder_and_joiner(client, manifest, damaged)
    path, report = _fetch_on(client, joiner, manifest, tmp_path / "copy", [holder], str(root))
    # Dropped at the second; the third may have been asked for already (chunks in flight).
    assert report["corrupted"] in (2, 3)
    assert report["failed_peers"] == [holder]
    assert f"{report['corrupted']} corrupted" in report["peers"][holder]
    assert report["chunks_from_source"] >= 2
    _same_files(manifest, root, path)


def test_a_failing_peer_is_dropped_and_the_source_finishes(inproc_cluster, template, tmp_path):
    _, client = inproc_cluster
    manifest, root = template

    def die_after_three(serve):
        left = [3]

        async def flaky(digest, index):
            if not left[0]:
                raise OSError("peer went away")
            left[0] -= 1
            return await serve(digest, index)

        return flaky

    holder, joiner = _holder_and_joiner(client, manifest, root, die_after_three)
    path, report = _fetch_on(client, joiner, manifest, tmp_path / "copy", [holder], str(root))
    assert report["failed_peers"] == [holder]
    assert report["chunks_from_peers"] == 3
    assert report["chunks_from_source"] == manifest.nchunks - 3
    _same_files(manifest, root, path)
    # Each chunk received once, in its timeline: from where, when asked, when its bytes were in.
    timeline = report["timeline"]
    assert sorted(index for index, *_ in timeline) == list(range(manifest.nchunks))
    assert sorted(peer for _, peer, *_ in timeline) == [""] * (manifest.nchunks - 3) + [holder] * 3
    assert all(asked <= arrived for *_, asked, arrived in timeline)


def test_no_peer_and_no_source_is_a_clear_error(inproc_cluster, template, tmp_path):
    _, client = inproc_cluster
    manifest, _ = template
    _, joiner = _workers(client)
    with pytest.raises(TemplateFetchError, match="could not be had from any peer"):
        _fetch_on(client, joiner, manifest, tmp_path / "copy", [], None)
    assert not list(tmp_path.glob(".copy*"))  # the partial copy was removed


def test_source_reads_go_through_the_shared_bandwidth(template, tmp_path):
    import asyncio
    import uuid
    from types import SimpleNamespace

    manifest, root = template
    link = SharedBandwidth(manifest.total_bytes / 0.5, name=f"t-{uuid.uuid4().hex}")  # ~0.5 s
    reader = ThrottledReader(link, manifest.chunk_size)
    fake_worker = SimpleNamespace(address="tcp://nowhere:1", extensions={}, handlers={})
    start = time.perf_counter()
    path, report = asyncio.run(
        fetch(fake_worker, manifest, tmp_path / "copy", root, SourcePlanner(), reader)
    )
    assert time.perf_counter() - start >= 0.45
    assert report.bytes_from_source == manifest.total_bytes
    _same_files(manifest, root, path)
    shutil.rmtree(path)


def _logits(prompt: str) -> tuple[str, list[float]]:
    from distributed import get_worker

    import dask_pcm

    lm = dask_pcm.get_context("tiny")
    return get_worker().address, lm.next_token_logits([prompt])[0, :50].tolist()


def test_workers_get_the_template_from_peers_and_build_the_same_model(
    inproc_cluster, tiny_model_dir, tmp_path
):
    import torch

    import dask_pcm
    from dask_pcm.engine.llm import CausalLM

    cluster, client = inproc_cluster
    with dask.config.set({"pcm.cache-directory": str(tmp_path / "cache")}):
        dask_pcm.register(client, dask_pcm.causal_lm(tiny_model_dir, name="tiny", device="cpu"))
    total = build_manifest(tiny_model_dir)[0].total_bytes
    table = dask_pcm.status(client).set_index("worker")
    # Copies run side by side (outside the host's load slot): the two split the source
    # through the chunk directory and copy the rest from each other.
    assert table["bytes_from_source"].sum() == total
    assert table["bytes_from_peers"].sum() == total
    assert table["template_held"].all()

    cluster.scale(3)
    client.wait_for_workers(3, timeout=30)
    (joiner,) = set(client.scheduler_info()["workers"]) - set(table.index)
    deadline = time.monotonic() + 60
    while (row := dask_pcm.status(client).set_index("worker").loc[joiner])["state"] != "ready":
        assert time.monotonic() < deadline, row["state"]
        time.sleep(0.1)
    assert (row["bytes_from_peers"], row["bytes_from_source"]) == (total, 0)
    assert row["location"] != str(tiny_model_dir)  # built from its own local copy

    prompt = "The claim is supported by the evidence:"
    expected = CausalLM(device="cpu")(str(tiny_model_dir)).next_token_logits([prompt])[0, :50]
    results = client.gather(
        [client.submit(dask_pcm.ContextTask(_logits, "tiny"), prompt, workers=[w], pure=False)
         for w in client.scheduler_info()["workers"]]
    )  # fmt: skip
    assert {w for w, _ in results} == set(client.scheduler_info()["workers"])
    for _, logits in results:
        torch.testing.assert_close(torch.tensor(logits), expected, atol=1e-5, rtol=1e-5)


def test_workers_joining_together_split_the_source_and_share_the_rest(tiny_model_dir, tmp_path):

    import dask_pcm

    total = build_manifest(tiny_model_dir, 16 * KIB)[0].total_bytes
    settings = {
        "pcm.cache-directory": str(tmp_path / "cache"),
        "pcm.template.chunk-size": "16 KiB",
        "pcm.template.source-bandwidth": int(total / 1.5),  # one whole read: 1.5 s
        "pcm.worker.load-concurrency": 2,
    }
    with cluster_client(n_workers=0, config=settings) as client:
        SharedBandwidth(1, name="template-source").reset()
        dask_pcm.register(client, dask_pcm.causal_lm(tiny_model_dir, name="tiny", device="cpu"))
        client.cluster.scale(2)
        client.wait_for_workers(2, timeout=30)
        deadline = time.monotonic() + 60
        while not (table := dask_pcm.status(client))["state"].eq("ready").all() or len(table) < 2:
            assert time.monotonic() < deadline, table[["worker", "state"]]
            time.sleep(0.1)
    # Every chunk was read from the source once, by one of the two, and copied to the other.
    assert table["bytes_from_source"].sum() == total
    assert table["bytes_from_peers"].sum() == total


def test_a_peer_process_killed_mid_transfer_does_not_stop_the_joiner(tiny_model_dir, tmp_path):
    """SIGKILL the only holder while a joiner copies from it: the joiner still gets ready."""
    import os
    import signal

    import torch

    import dask_pcm
    from dask_pcm.engine.llm import CausalLM

    marker = tmp_path / "serving"
    total = build_manifest(tiny_model_dir, 16 * KIB)[0].total_bytes

    def slow_uploads(dask_worker=None):
        serve = TemplateStore.of(dask_worker).serve

        async def slow(digest, index):
            import asyncio

            await asyncio.sleep(0.2)  # ~20 chunks/s: the copy takes seconds, not milliseconds
            data = await serve(digest, index)
            with open(marker, "a") as served:
                served.write(f"{index}\n")
            return data

        dask_worker.handlers["pcm_template_chunk"] = slow
        return os.getpid()

    with _one_holder(tiny_model_dir, tmp_path, processes=True) as (cluster, client, holder):
        pid = client.run(slow_uploads, workers=[holder])[holder]
        joiner = _add_joiner(cluster, client, holder)
        deadline = time.monotonic() + 60
        while not marker.exists() or len(marker.read_text().split()) < 4:
            assert time.monotonic() < deadline, "the joiner never got chunks from the holder"
            time.sleep(0.02)
        os.kill(pid, signal.SIGKILL)  # the nanny restarts it under a new address

        row = _wait_ready(client, joiner, 90)
        assert 0 < row["bytes_from_peers"] < total  # part came from the killed holder...
        assert row["bytes_from_peers"] + row["bytes_from_source"] >= total  # ...the rest elsewhere
        assert holder not in dask_pcm.status(client)["worker"].tolist()

        prompt = "The claim is supported by the evidence:"
        expected = CausalLM(device="cpu")(str(tiny_model_dir)).next_token_logits([prompt])
        future = client.submit(
            dask_pcm.ContextTask(_logits, "tiny"), prompt, workers=[joiner], pure=False
        )
        where, logits = future.result(timeout=60)
        assert where == joiner
        torch.testing.assert_close(torch.tensor(logits), expected[0, :50], atol=1e-5, rtol=1e-5)


def test_a_chunk_asked_for_while_the_copy_is_moved_into_place_is_still_served(template, tmp_path):
    """A partial copy completes (staging renamed to its final place) while a peer's request
    for one of its chunks is being served: the chunk comes from the complete copy."""
    import asyncio
    from types import SimpleNamespace

    from dask_pcm.templates.manifest import TemplateWriter, read_chunk

    manifest, root = template

    async def scenario() -> bytes:
        store = TemplateStore(SimpleNamespace(handlers={}, address="tcp://w:1"), max_uploads=2)
        writer = TemplateWriter(manifest, tmp_path / "copy")
        for i in range(manifest.nchunks):
            writer.write(i, read_chunk(root, manifest, i))
        store.add_partial(writer)
        final = writer.finish()  # staging is gone; the store does not know yet

        async def announce_later() -> None:
            await asyncio.sleep(0.3)
            store.add(final, manifest)

        served, _ = await asyncio.gather(store.serve(manifest.digest, 1), announce_later())
        return bytes(served.data)

    assert asyncio.run(scenario()) == read_chunk(root, manifest, 1)


def test_a_joiner_whose_only_peer_keeps_failing_reads_the_source(tiny_model_dir, tmp_path):
    """The scheduler keeps naming a broken but connected holder: the joiner stops asking it
    and reads what only it holds from the source instead of waiting forever."""
    total = build_manifest(tiny_model_dir, 16 * KIB)[0].total_bytes

    def broken(dask_worker=None):
        async def fail(digest, index):
            raise OSError("disk gone")

        dask_worker.handlers["pcm_template_chunk"] = fail

    with _one_holder(tiny_model_dir, tmp_path) as (cluster, client, holder):
        client.run(broken, workers=[holder])
        row = _wait_ready(client, _add_joiner(cluster, client, holder), 60)
    assert (row["bytes_from_peers"], row["bytes_from_source"]) == (0, total)


def test_a_joiner_whose_only_peer_holds_a_corrupted_copy_is_ready_from_the_source(
    tiny_model_dir, tmp_path, caplog
):
    """The holder's copy on disk is damaged (100 bytes zeroed in three chunks): the joiner
    drops it after two bad chunks, the directory stops offering it, and the joiner is ready
    from the source within a minute, with a handful of warnings (it used to ask the same
    peer again forever, 15,000 warnings a minute)."""
    import logging

    import dask_pcm

    with _one_holder(tiny_model_dir, tmp_path) as (cluster, client, holder):
        copy = Path(dask_pcm.status(client).set_index("worker").loc[holder, "location"])
        _damage(copy / "model.safetensors", [40 * KIB, 200 * KIB, 400 * KIB])
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="dask_pcm"):
            row = _wait_ready(client, _add_joiner(cluster, client, holder), 60)
        plugin = client.run_on_scheduler(
            lambda dask_scheduler: {
                i: sorted(w) for i, w in dask_scheduler.plugins["dask-pcm"].directory.bad_holders.popitem()[1].items()
            }
        )  # fmt: skip
    assert row["corrupted_chunks"] >= 1
    assert row["bytes_from_source"] > 0
    assert [holder] in plugin.values()  # the directory no longer offers it for those chunks
    warnings = [r for r in caplog.records if r.name.startswith("dask_pcm")]
    assert 1 <= len(warnings) <= 5, [r.getMessage() for r in warnings]


def test_a_joiner_whose_only_peer_is_frozen_is_ready_from_the_source(tiny_model_dir, tmp_path):
    """SIGSTOP the only holder (a frozen or swapping node): the joiner's chunk request
    expires at its deadline, the peer is dropped, the source serves the copy (it used to
    wait on the open connection forever)."""
    import os
    import signal

    from dask_pcm import config

    settings = {
        "pcm.template.chunk-size": "64 KiB",
        "pcm.template.peer-connect-timeout": "2s",
        "pcm.template.peer-min-bandwidth": "1 MiB/s",
    }
    with _one_holder(tiny_model_dir, tmp_path, True, settings) as (cluster, client, holder):
        deadline = config.peer_deadline(64 * KIB)  # 2 s + 1/16 s
        pid = client.run(os.getpid, workers=[holder])[holder]
        os.kill(pid, signal.SIGSTOP)
        try:
            row = _wait_ready(client, _add_joiner(cluster, client, holder), deadline + 30)
        finally:
            os.kill(pid, signal.SIGCONT)
    assert row["bytes_from_source"] == build_manifest(tiny_model_dir, 64 * KIB)[0].total_bytes
    assert row["bytes_from_peers"] == 0
    # The copy: one request that expired at its deadline, then the source. (Time to ready
    # adds the new process's torch import and build: seconds, more under load.)
    assert row["fetch_seconds"] < deadline + 3


def test_a_reused_local_copy_is_verified_before_it_is_used_or_served(tiny_model_dir, tmp_path):
    """A worker finds a complete copy left in its template folder by an earlier worker, but
    damaged since: it checks every chunk, fetches the template again, builds from good bytes."""

    import dask_pcm

    settings = {
        "pcm.cache-directory": str(tmp_path / "cache"),
        "pcm.template.chunk-size": "16 KiB",
        "pcm.worker.template-directory": str(tmp_path / "scratch"),
    }
    context = dask_pcm.causal_lm(tiny_model_dir, name="tiny", device="cpu")
    manifest = build_manifest(tiny_model_dir, 16 * KIB)[0]
    for attempt in range(2):
        with cluster_client(config=settings) as client:
            dask_pcm.register(client, context)
            row = dask_pcm.status(client).iloc[0]
        copy = Path(row["location"])
        if attempt == 0:
            assert row["bytes_from_source"] == manifest.total_bytes
            _damage(copy / "model.safetensors", [100 * KIB])
    assert row["bytes_from_source"] == manifest.total_bytes  # fetched again, not trusted
    _same_files(manifest, tiny_model_dir, copy)


def test_a_copy_past_its_deadline_fails_naming_each_peer(inproc_cluster, template, tmp_path):
    """A peer answers, but too slowly for the copy's deadline: the copy ends with a
    TemplateFetchError that says what is missing and what the peer did."""
    _, client = inproc_cluster
    manifest, root = template

    def crawl(serve):
        async def slow(digest, index):
            import asyncio

            await asyncio.sleep(0.3)  # within the request deadline, too slow for the copy
            return await serve(digest, index)

        return slow

    holder, joiner = _holder_and_joiner(client, manifest, root, crawl)
    start = time.monotonic()
    with (
        dask.config.set({"pcm.template.fetch-timeout": "1s"}),
        pytest.raises(TemplateFetchError) as caught,
    ):
        _fetch_on(client, joiner, manifest, tmp_path / "copy", [holder], None)
    assert time.monotonic() - start < 5
    message = str(caught.value)
    assert "pcm.template.fetch-timeout" in message and "chunks missing" in message
    assert f"{holder} served " in message
    assert not list(tmp_path.glob(".copy*"))  # the partial copy was removed


def _other_loader(location: str) -> str:
    return f"built from {location}"


ASKED: list[int] = []  # chunks asked of _crawl's worker (in-process workers share it)


def _crawl(dask_worker=None):
    """Make this worker serve a chunk every 2 s (module level: shipped by reference)."""
    serve = TemplateStore.of(dask_worker).serve

    async def slow(digest, index):
        import asyncio

        ASKED.append(index)
        await asyncio.sleep(2)
        return await serve(digest, index)

    dask_worker.handlers["pcm_template_chunk"] = slow


def test_a_slow_copy_does_not_hold_up_another_contexts_load(tiny_model_dir, tmp_path):
    """While a joiner's template copy crawls (a slow peer), a second context still loads on
    it at once: copies wait on the network outside the host's load slot."""
    import dask_pcm

    with _one_holder(tiny_model_dir, tmp_path) as (cluster, client, holder):
        ASKED.clear()
        client.run(_crawl, workers=[holder])
        joiner = _add_joiner(cluster, client, holder)
        deadline = time.monotonic() + 30
        while not ASKED:  # the joiner's copy is under way
            assert time.monotonic() < deadline
            time.sleep(0.05)
        other = dask_pcm.Context("other", _other_loader, template="not-a-file", level="full")
        table = dask_pcm.register(client, other).set_index("worker")
        copying = dask_pcm.status(client, ["tiny"]).set_index("worker").loc[joiner, "state"]
    assert table.loc[joiner, "state"] == "ready"
    assert copying != "ready"  # the copy was still crawling when the other was ready


def test_peer_copies_work_over_tls(tiny_model_dir, tmp_path):
    """With TLS between all (distributed's Security.temporary()), a joiner still copies the
    whole template from its peer."""
    from distributed.security import Security

    import dask_pcm

    security = Security.temporary()
    total = build_manifest(tiny_model_dir, 16 * KIB)[0].total_bytes
    settings = {
        "pcm.cache-directory": str(tmp_path / "cache"),
        "pcm.template.chunk-size": "16 KiB",
    }
    with cluster_client(config=settings, protocol="tls://", security=security) as client:
        dask_pcm.register(client, dask_pcm.causal_lm(tiny_model_dir, name="tiny", device="cpu"))
        (holder,) = _workers(client)
        joiner = _add_joiner(client.cluster, client, holder)
        row = _wait_ready(client, joiner, 60)
    assert holder.startswith("tls://") and joiner.startswith("tls://")
    assert (row["bytes_from_peers"], row["bytes_from_source"]) == (total, 0)
