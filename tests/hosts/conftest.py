"""Fixtures of the tests on emulated hosts (:mod:`dask_pcm.testing.hosts`): network namespaces
with capped links on a private bridge, a scheduler in this process listening on the bridge.

They need root, ``ip``, ``tc`` and ``ebtables`` (``sudo bash ci/hosts/setup.sh``); without them
the tests skip with the reason, unless ``PCM_REQUIRE_HOSTS=1`` (as in CI) makes that a failure.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import dask
import pytest
from distributed import Client

from dask_pcm.testing import hosts
from tests.conftest import wait_for


def require_hosts() -> None:
    reason = hosts.unavailable()
    if reason:
        message = f"no emulated hosts here: {reason}"
        if os.environ.get("PCM_REQUIRE_HOSTS"):
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture
def network(tmp_path: Path) -> Iterator[hosts.HostNetwork]:
    """An emulated network with no hosts yet (``network.add_host(link=...)``), removed with
    everything in it at the end of the test."""
    require_hosts()
    with hosts.HostNetwork(directory=tmp_path / "hosts") as net:
        yield net


@contextlib.contextmanager
def cluster_on(
    network: hosts.HostNetwork, settings: Mapping[str, Any] | None = None
) -> Iterator[tuple[Any, Client]]:
    """A dask_pcm cluster with no workers whose scheduler (in this process) listens on the
    network's bridge, and its client; ``settings`` apply to this process (the scheduler and
    client) and to every process the network's hosts start from now on."""
    import dask_pcm

    settings = dict(settings or {})
    network.settings.update(settings)
    with (
        dask.config.set(settings),
        dask_pcm.local_cluster(n_workers=0, host=network.address, dashboard_address=":0") as cl,
        Client(cl) as client,
    ):
        yield cl, client


def start_workers(
    client: Client, scheduler: str, on: list[hosts.Host], seconds: float = 90
) -> dict[str, str]:
    """A worker in each host of ``on``; ``{host name: worker address}`` once all are in."""
    for host in on:
        host.start_worker(scheduler)
    names = {host.name for host in on}

    def joined() -> dict[str, str] | None:
        info = client.scheduler_info(n_workers=-1)["workers"]
        found = {w["name"]: address for address, w in info.items() if w["name"] in names}
        return found if len(found) == len(names) else None

    try:
        return wait_for(joined, seconds, f"workers on {sorted(names)}")
    except AssertionError:
        logs = "\n".join(f"--- {h.name}:\n{h.log()[-2000:]}" for h in on)
        raise AssertionError(
            f"workers did not join in {seconds:g} s; their logs:\n{logs}"
        ) from None


@pytest.fixture(scope="session")
def small_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Llama of 12 MB (hidden size 256, 4 layers): a template whose copy over an
    emulated link of a few Mbit/s takes seconds, not milliseconds."""
    from dask_pcm.testing import build_tiny_llama

    path = tmp_path_factory.mktemp("models") / "small-llama"
    return build_tiny_llama(path, hidden_size=256, num_layers=4, num_heads=4)


def status_of(client: Client, context: str) -> Any:
    """:func:`dask_pcm.status` of ``context``, indexed by worker address."""
    import dask_pcm

    return dask_pcm.status(client, [context]).set_index("worker")


def wait_ready(client: Client, context: str, workers: list[str], seconds: float) -> Any:
    """The status rows of ``workers`` once ``context`` is ready on each; a failure on one of
    them fails at once, naming its error."""

    def ready() -> bool:
        table = status_of(client, context)
        rows = table[table.index.isin(workers)]
        failed = rows[rows["state"] == "failed"]
        assert failed.empty, failed["error"].to_dict()
        return len(rows) == len(workers) and bool(rows["state"].eq("ready").all())

    wait_for(ready, seconds, f"{context} ready on {workers}")
    return status_of(client, context).loc[workers]


def chunks_held(client: Client, digest: str) -> dict[str, int]:
    """Chunks of template ``digest`` each worker holds, by the scheduler's chunk directory
    (a worker holding a whole copy is counted apart from the directory's partial holders)."""

    def count(dask_scheduler: Any = None) -> dict[str, int]:
        directory = dask_scheduler.plugins["dask-pcm"].directory
        held: dict[str, int] = {}
        for workers in directory.holders.get(digest, {}).values():
            for worker in workers:
                held[worker] = held.get(worker, 0) + 1
        return held

    return client.run_on_scheduler(count)
