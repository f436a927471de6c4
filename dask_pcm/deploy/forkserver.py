"""The workers of a local cluster forked from one process that imported torch once.

A spawned worker process starts a fresh interpreter and imports distributed, torch and
transformers by itself: on a host where every worker starts at once, each pays the imports
again, on the same cores, before it can read a byte of its model. With
``pcm.worker.fork-server`` (Linux), :func:`dask_pcm.local_cluster` starts its nannies' worker
processes with multiprocessing's *forkserver* method instead: one server process imports
distributed and ``pcm.worker.preimport-modules`` once (:mod:`dask_pcm.deploy.fork_imports`),
and every worker is forked from it with those modules already in memory (shared
copy-on-write between the workers).

:func:`start` starts that server as early as the cluster is asked for, so its imports run
while the client starts the scheduler. The server is started with the environment a
spawned worker would get (``distributed.nanny.pre-spawn-environ``: ``OMP_NUM_THREADS`` and its
kin, which the thread pools of torch read when it is imported; ``PYTHONHASHSEED``; without
``MALLOC_TRIM_THRESHOLD_`` when ``pcm.worker.disable-malloc-trim``), because a forked worker
keeps what its server read at import. No CUDA context exists in the server: importing torch
does not create one, and each worker's own ``CUDA_VISIBLE_DEVICES`` is set in it before its
first use of a GPU, as for a spawned worker.

distributed reads ``distributed.worker.multiprocessing-method`` when a nanny starts its worker
process; :func:`method` gives the setting for the clusters dask_pcm starts, which apply it
only while they start their workers (:func:`dask_pcm.local_cluster`), so the process-wide
configuration stays as it was and a worker that its nanny restarts later is spawned.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator

import dask.config

from dask_pcm import config

logger = logging.getLogger(__name__)

#: The module the fork server imports: distributed, then ``pcm.worker.preimport-modules``.
IMPORTS = "dask_pcm.deploy.fork_imports"
_METHOD_KEY = "distributed.worker.multiprocessing-method"
# distributed's nanny gives spawned workers this seed when none is set, so that they hash
# alike (distributed.nanny, "consistent hashing on subprocesses").
_HASH_SEED = "6640"


def usable() -> bool:
    """Whether workers should come from the fork server here: ``pcm.worker.fork-server``
    on, on Linux (elsewhere forking a process that holds torch's libraries is not safe),
    and distributed left at its own start method (a user's explicit choice wins)."""
    return (
        bool(config.get("worker.fork-server"))
        and sys.platform.startswith("linux")
        and dask.config.get(_METHOD_KEY) == "spawn"
    )


def _server_environment() -> dict[str, str | None]:
    """The variables a spawned worker gets before it starts (``None``: removed)."""
    env: dict[str, str | None] = {
        key: str(value)
        for key, value in (dask.config.get("distributed.nanny.pre-spawn-environ") or {}).items()
        if value is not None
    }
    # As the nanny: a variable already in the environment wins over the configuration.
    env = {key: os.environ.get(key, value) for key, value in env.items()}
    if env.get("PYTHONHASHSEED") in (None, "0"):
        env["PYTHONHASHSEED"] = _HASH_SEED
    if config.get("worker.disable-malloc-trim"):
        env["MALLOC_TRIM_THRESHOLD_"] = None
    return env


@contextlib.contextmanager
def _environment(env: dict[str, str | None]) -> Iterator[None]:
    saved = {key: os.environ.get(key) for key in env}
    try:
        for key, value in env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def start() -> bool:
    """Start the fork server now (its imports run in the background) if :func:`usable`;
    whether workers will be forked from it. Idempotent: the server lives as long as this
    process and serves every local cluster it starts."""
    if not usable():
        return False
    from multiprocessing import forkserver

    import distributed.utils

    # distributed sets its own list of modules for the server the first time it is asked
    # for the method, once per process: asked first, so that ours replaces it.
    with dask.config.set({_METHOD_KEY: "forkserver"}):
        context = distributed.utils.get_mp_context()
    # Not '__main__': a worker needs none of the user's script, and a script without the
    # __main__ guard would run again in the server.
    context.set_forkserver_preload(["distributed", IMPORTS])
    try:
        with _environment(_server_environment()):
            forkserver.ensure_running()
    except Exception as exc:  # a worker spawned fresh works too, only later
        logger.warning("Could not start the fork server for workers (%r): spawning them", exc)
        return False
    return True


@contextlib.contextmanager
def method(forked: bool) -> Iterator[None]:
    """distributed's start method while a cluster starts its workers: ``forkserver`` where
    :func:`start` started the server, else left as it is."""
    if not forked:
        yield
        return
    with dask.config.set({_METHOD_KEY: "forkserver"}):
        yield
