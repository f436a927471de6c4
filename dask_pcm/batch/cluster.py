"""Where a batch run's workers come from, and what it tells the user while it runs.

:func:`open_client` turns ``run_batch``'s ``cluster`` argument into a client: a local
cluster, batch-system jobs, a scheduler address, or the caller's own client or cluster (left
open at the end, so that its resident contexts serve the next run; a client the run made
for an address or a cluster object is closed, so that none is left to reconnect to a
scheduler that the caller closes later). For a local cluster the run starts,
:class:`HostCopies` makes the host's copy of each template while the cluster comes up.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any

from distributed import Client

from dask_pcm import client as pcm
from dask_pcm.context import Context
from dask_pcm.deploy import KINDS, worker_setup
from dask_pcm.deploy.local import local_cluster
from dask_pcm.gpus import visible_gpus
from dask_pcm.templates.local import HostCopy
from dask_pcm.templates.tree import list_template

logger = logging.getLogger(__name__)

#: Most worker jobs of a batch cluster that a run starts itself (``workers`` unset).
BATCH_WORKERS = 4
_ADDRESS_SCHEMES = ("tcp://", "tls://", "ucx://", "inproc://", "ws://", "wss://")


class HostCopies:
    """The host copies of a run's templates, made by the client while the local cluster it
    starts comes up (:class:`~dask_pcm.templates.local.HostCopy`): the cluster's start is
    the fork server's imports, which leave the disk idle, and the first worker to ask
    would otherwise make the copy only then, before it can load its model.

    A thread lists and hashes the templates (:meth:`wait_listed`: before the contexts are
    registered, so that their plugins carry the copies' stamps), then copies them.
    :meth:`release` stops a copy still running (a run that failed early) and lets go of
    the copies: call it after the cluster closed. For a cluster the run does not start,
    nothing is made.
    """

    def __init__(self, contexts: Iterable[tuple[Context, str | None]] = ()) -> None:
        self.copies: list[HostCopy] = []
        self._listed = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(list(contexts),), name="dask-pcm-host-copies", daemon=True
        )
        self._thread.start()

    @classmethod
    def for_run(
        cls, cluster: Any, contexts: Iterable[Context | None], level: str | None
    ) -> HostCopies:
        """Copies for a run on ``cluster`` (``run_batch``'s argument): for a local cluster
        that the run starts, of ``contexts`` (None: registered already) at ``level``."""
        if not (cluster is None or cluster == "local"):
            return cls()
        return cls((c, level) for c in contexts if c is not None)

    def _run(self, contexts: list[tuple[Context, str | None]]) -> None:
        try:
            scratch = worker_setup.scratch_directory()
            directory = worker_setup.host_template_directory()
            seen: set[str] = set()
            for ctx, level in contexts:
                try:
                    chosen = pcm.context_level(ctx, level)
                    manifest = pcm.copy_manifest(ctx, chosen)  # None at level agnostic
                    if manifest is None or ctx.template is None or manifest.digest in seen:
                        continue
                    root = list_template(ctx.template, ctx.loader).root
                except Exception as exc:  # the workers meet it too, and report it
                    logger.info("No host copy of %r made ahead: %s", ctx.name, exc)
                    continue
                seen.add(manifest.digest)
                self.copies.append(HostCopy(manifest, root, directory, scratch))
        finally:
            self._listed.set()
        for copy in self.copies:
            copy.make()

    def wait_listed(self) -> None:
        """Block until the templates are listed and hashed (their copies may go on)."""
        self._listed.wait()

    def release(self) -> None:
        """Stop the copies still being made, and let go of them all (see the class
        docstring)."""
        self._listed.wait()
        for copy in self.copies:
            copy.cancel()
        self._thread.join()
        for copy in self.copies:
            copy.release()


def open_client(
    cluster: Any, workers: int | None, progress: bool, whole_cores: bool = False
) -> tuple[Client, Callable[[], None]]:
    """A client for ``cluster``, and what closes what the run opened: the client and its
    cluster for a cluster the run starts, the client alone for an address or a cluster
    object, nothing for a client of the caller's.

    ``None`` or ``"local"``: a local cluster (``workers`` processes, default one per GPU or
    core). ``"sge"``, ``"htcondor"``: batch jobs scaled between 1 and ``workers`` (default
    4). A scheduler address (``"tcp://..."``), a ``distributed.Client`` or a cluster object:
    used as it is.

    ``whole_cores``: the local cluster's workers share the cores among them as threads (by
    default one worker per GPU, else one), for contexts that run one engine per worker on
    all its threads (:attr:`dask_pcm.engine.vllm.VLLM.one_engine_per_worker`).
    """
    if cluster is None or cluster == "local":
        if whole_cores:
            n = workers or len(visible_gpus()) or 1
            threads = max(1, len(os.sched_getaffinity(0)) // n)
            client = Client(local_cluster(n_workers=n, threads_per_worker=threads))
        else:
            client = Client(local_cluster(n_workers=workers))
    elif isinstance(cluster, Client):
        return cluster, lambda: None
    elif isinstance(cluster, str) and cluster.startswith(_ADDRESS_SCHEMES):
        client = Client(cluster)
        return client, client.close
    elif isinstance(cluster, str):
        if cluster.lower() not in KINDS:
            raise ValueError(
                f"cluster={cluster!r}: one of 'local', {', '.join(map(repr, KINDS))}, or a "
                "scheduler address such as 'tcp://host:8786'"
            )
        # Worker jobs come and go as the units need them; the site's job settings come
        # from dask-jobqueue's configuration (jobqueue.sge / jobqueue.htcondor).
        maximum = workers or BATCH_WORKERS
        from dask_pcm.deploy.jobqueue import batch_cluster  # imports dask-jobqueue

        client = Client(batch_cluster(cluster, minimum=1, maximum=maximum))
    elif hasattr(cluster, "scheduler_address"):
        client = Client(cluster)
        return client, client.close
    else:
        raise TypeError(
            f"cluster must be None, a name, a scheduler address, a distributed.Client or a "
            f"cluster, got {cluster!r}"
        )
    if progress:
        # Where to watch: the cluster is ours, so the user has no other way to know.
        print(
            f"Dask dashboard: {client.dashboard_link}\nContexts:       {pcm.status_page(client)}",
            file=sys.stderr,
            flush=True,
        )
    return client, lambda: close_client(client)


def close_client(client: Client) -> None:
    """Close ``client`` and the cluster it started."""
    cluster = client.cluster
    client.close()
    if cluster is not None:
        cluster.close()


def workers_report(
    client: Client, contexts: list[str], served: dict[str, int]
) -> list[dict[str, Any]]:
    """Per worker and context: loads, load seconds (one status read) and the run's tasks
    that worker ran, ``served`` (every task of a run uses all of its contexts)."""
    return [
        {
            "worker": r.worker,
            "context": r.context,
            "loads": int(r.loads),
            "load_seconds": float(r.load_seconds),
            "tasks": served.get(r.worker, 0),
        }
        for r in pcm.status(client, contexts).itertuples()
    ]


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def set_postfix_str(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, enabled: bool) -> Any:
    """A tqdm bar of units (or one that shows nothing)."""
    if not enabled or total == 0:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="units", unit="unit")
