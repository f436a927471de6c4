"""One GPU per worker process: each nanny gives its worker its own ``CUDA_VISIBLE_DEVICES``.

Without it every worker process on a node opens GPU 0: ``local_cluster()`` started one
worker per core, and many Grid Engine sites bind no GPU to a job. A nanny claims one of the
GPUs it may see (``CUDA_VISIBLE_DEVICES``, else every GPU the driver lists) with a host-wide
lock before it starts its worker, so workers of one cluster, and the jobs of one user on a
node, take different GPUs. With more workers than GPUs the extra ones share, one more per
GPU in turn, and say so in the log. The kernel drops a claim when its holder dies.

The dask_pcm worker setup (:mod:`dask_pcm.deploy.worker_setup`, the nanny preload of
:class:`dask_pcm.Nanny`, ``dask-pcm worker`` and :func:`dask_pcm.batch_cluster` jobs) calls
:func:`bind` and :func:`unbind`. ``pcm.worker.gpu-per-worker: false`` turns it off.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from typing import Any

from dask_pcm import config
from dask_pcm.gpus import VISIBLE, visible_gpus
from dask_pcm.locks import lock_dir, try_lock, unlock

logger = logging.getLogger(__name__)

PRELOAD = "dask_pcm.deploy.gpu"
"""This module as a nanny preload: the GPU binding alone, as job scripts written before
:mod:`dask_pcm.deploy.worker_setup` name it (which binds the GPU and sets up the rest)."""

_MAX_SHARING = 64
_CLAIM = "_dask_pcm_gpu"


@dataclass(frozen=True)
class GPUClaim:
    """One GPU (a ``CUDA_VISIBLE_DEVICES`` entry) held by one worker: ``slot`` 0 alone,
    1 and up when more workers than GPUs share it."""

    entry: str
    slot: int
    fd: int


def claim_gpu(visible: list[str], note: str) -> GPUClaim | None:
    """Claim the least shared of ``visible``; ``None`` when there is no GPU to claim."""
    folder = lock_dir()
    for slot in range(_MAX_SHARING):
        for entry in visible:
            safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in entry)
            try:
                fd = try_lock(folder / f"gpu-{safe}.{slot}.lock", note)
            except BlockingIOError:
                continue
            return GPUClaim(entry, slot, fd)
    return None


def bind(nanny: Any) -> GPUClaim | None:
    """Give ``nanny``'s worker one GPU: set ``CUDA_VISIBLE_DEVICES`` in the nanny's
    environment for its worker process. Idempotent; a no-op on a host without GPUs."""
    claim: GPUClaim | None = getattr(nanny, _CLAIM, None)
    if claim is not None or not config.get("worker.gpu-per-worker"):
        return claim
    env: dict[str, str] = nanny.env
    # What the nanny was told to see (env=...), else what this process sees.
    visible = visible_gpus(env if VISIBLE in env else None)
    if not visible:
        return None
    host = socket.gethostname()
    claim = claim_gpu(visible, f"{host} pid {os.getpid()} nanny {nanny.name}")
    if claim is None:
        logger.warning("No GPU left to claim on %s for worker %s", host, nanny.name)
        return None
    setattr(nanny, _CLAIM, claim)
    env[VISIBLE] = claim.entry
    if claim.slot:
        logger.warning(
            "GPU %s on %s is shared by %d workers: more workers than GPUs (%s)",
            claim.entry,
            host,
            claim.slot + 1,
            ",".join(visible),
        )
    else:
        logger.info("Worker %s on %s uses GPU %s", nanny.name, host, claim.entry)
    return claim


def unbind(nanny: Any) -> None:
    """Give ``nanny``'s GPU back (when it closes)."""
    claim: GPUClaim | None = getattr(nanny, _CLAIM, None)
    if claim is not None:
        setattr(nanny, _CLAIM, None)
        unlock(claim.fd)


# The nanny preload interface (distributed calls these with the nanny), for command lines
# that still name this module; the worker setup binds the GPU itself.
def dask_setup(nanny: Any) -> None:
    logger.info(
        "--preload-nanny %s binds the GPU only; dask_pcm.deploy.worker_setup (what "
        "`dask-pcm worker` and batch_cluster use) binds it and sets up the rest",
        PRELOAD,
    )
    bind(nanny)


def dask_teardown(nanny: Any) -> None:
    unbind(nanny)
