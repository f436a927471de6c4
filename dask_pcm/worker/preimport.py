"""A worker preload: heavy imports started when the worker starts, not when a context arrives.

A fresh worker process that loads a causal LM spends seconds importing torch and
transformers before it reads a byte of the model. Started as a preload (``--preload
dask_pcm.worker.preimport``, which the dask_pcm worker setup,
:mod:`dask_pcm.deploy.worker_setup`, gives every worker), this module imports the modules of
``pcm.worker.preimport-modules`` in a daemon thread of their own as the worker starts: the
imports then run while the worker connects and the client hashes and registers its contexts.

Nothing else on the worker imports them meanwhile: a build (:meth:`Holder.build
<dask_pcm.worker.holder.Holder.build>`) waits for :func:`wait`, and so do the worker's task
threads, each of which starts with a wait. Two threads importing transformers at once fail
("cannot import name ... from partially initialized module 'transformers.utils'"): one of
them gets a half-built module from Python's deadlock avoidance, as a first try showed. A
module that cannot be imported is logged and skipped: the load that needs it reports the
error.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from typing import Any

from dask_pcm import config, locks

logger = logging.getLogger(__name__)

_DONE = locks.IMPORTS_DONE  # set: nothing being imported


def wait(timeout: float | None = None) -> bool:
    """Block until the preimport (if one runs in this process) is done; whether it is."""
    return locks.wait_for_imports(timeout)


def preimport(modules: list[str]) -> threading.Thread:
    """Import ``modules`` in a daemon thread, in order; returns the thread (started).
    :func:`wait` blocks until it is done."""

    def run() -> None:
        try:
            for name in modules:
                began = time.perf_counter()
                try:
                    importlib.import_module(name)
                except Exception as exc:  # not installed, or broken: the load will say
                    logger.info("Preimport of %s failed: %s: %s", name, type(exc).__name__, exc)
                    continue
                logger.info("Imported %s in %.2f s", name, time.perf_counter() - began)
        finally:
            _DONE.set()

    _DONE.clear()
    thread = threading.Thread(target=run, name="dask-pcm-preimport", daemon=True)
    thread.start()
    return thread


def dask_setup(worker: Any) -> None:
    """distributed's preload hook: start importing ``pcm.worker.preimport-modules``; the
    worker's task threads each wait for it first (tasks queue behind)."""
    modules = list(config.get("worker.preimport-modules") or [])
    if modules:
        preimport(modules)
        for _ in range(worker.state.nthreads):
            worker.executor.submit(wait)
