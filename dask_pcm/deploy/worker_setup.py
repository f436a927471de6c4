"""The dask_pcm worker setup: one nanny preload, used by every way of starting workers.

distributed runs a nanny's preloads as the nanny starts, before it spawns its worker
process: :func:`dask_setup` edits what that process gets. Every dask_pcm worker has

- no ``MALLOC_TRIM_THRESHOLD_`` in its environment (``pcm.worker.disable-malloc-trim``).
  distributed's nanny sets it to 65536 (``distributed.nanny.pre-spawn-environ``); glibc then
  returns freed memory to the OS after almost every forward pass and fixes its mmap
  threshold, so the next pass page-faults its buffers in again, which slows CPU torch
  inference down;
- its statistical profiler sampled every ``pcm.worker.profile-interval`` instead of
  distributed's 10ms: each sample runs on the worker's event loop and walks the deep stacks
  of a forward pass;
- its event loop checked every ``pcm.tick-interval`` instead of distributed's 20ms. The
  nanny reads that setting before its preloads run, so where the nanny is made sets it for
  the nanny itself: :class:`dask_pcm.Nanny` and ``dask-pcm worker`` do (:func:`tick_config`);
  the nanny of a ``dask worker`` that only names this preload keeps distributed's;
- template copies in ``pcm-templates`` beside the workers' own folders
  (``dask-scratch-space``) unless ``pcm.worker.template-directory`` is set: the workers of a
  host share one copy of a model, not one each;
- the worker preloads of :data:`WORKER_PRELOADS`: :mod:`dask_pcm.worker.preimport` (torch and
  transformers imported in a thread as the worker starts, not when its first context
  arrives) and :mod:`dask_pcm.deploy.preemption` (a batch system's preemption warning,
  ``SIGUSR2``, turned into a graceful retirement; where nothing sends that signal, as on a
  laptop, the plugin only waits);
- on a host with GPUs, one GPU of its own (``CUDA_VISIBLE_DEVICES``, :mod:`dask_pcm.deploy.gpu`;
  ``pcm.worker.gpu-per-worker``), given back when the nanny closes.

Who applies it: :class:`dask_pcm.Nanny` (so :func:`dask_pcm.local_cluster`), the
``dask-pcm worker`` command (workers started by hand) and the jobs of
:func:`dask_pcm.batch_cluster` (``dask worker --preload-nanny dask_pcm.deploy.worker_setup``).
:func:`worker_settings` reports, from inside a worker, what it actually has.

Examples
--------
>>> client.run(worker_settings)                                  # doctest: +SKIP
{'tcp://10.0.0.5:40123': {'tick-interval': 0.1, 'profile-interval': 0.1,
 'MALLOC_TRIM_THRESHOLD_': None, ...}}
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

import dask.config
import distributed

from dask_pcm import config
from dask_pcm.deploy import gpu, preemption
from dask_pcm.gpus import VISIBLE

logger = logging.getLogger(__name__)

#: The host's template folder under the scratch space (:data:`SCRATCH`, distributed's).
TEMPLATES = "pcm-templates"
SCRATCH = "dask-scratch-space"

#: This module as a nanny preload (``dask worker --preload-nanny``).
PRELOAD = "dask_pcm.deploy.worker_setup"
#: The worker preload that starts the heavy imports (named: the nanny does not import it).
PREIMPORT = "dask_pcm.worker.preimport"
#: The worker preloads every dask_pcm worker gets, in this order.
WORKER_PRELOADS = (PREIMPORT, preemption.PRELOAD)
MALLOC_TRIM = "MALLOC_TRIM_THRESHOLD_"


def tick_config() -> dict[str, Any]:
    """``pcm.tick-interval`` as the distributed setting, for a process (scheduler, nanny)
    starting now; empty when null (distributed's own)."""
    tick = config.get("tick-interval")
    return {} if tick is None else {"distributed.admin.tick.interval": tick}


def with_nanny_preload(preload: Any) -> list[str]:
    """``preload`` (a nanny's ``preload_nanny``: ``None``, a name or a list) with
    :data:`PRELOAD` added; ``None`` stands for ``distributed.nanny.preload``."""
    if preload is None:
        preload = dask.config.get("distributed.nanny.preload") or []
    names = [preload] if isinstance(preload, str) else list(preload)
    return names if PRELOAD in names else [*names, PRELOAD]


def setup(nanny: distributed.Nanny) -> None:
    """Give ``nanny``'s worker process the dask_pcm settings (see the module doc).

    Call it before the nanny spawns its worker, as distributed calls :func:`dask_setup`.
    Idempotent: a nanny that lists the preload twice is set up once.
    """
    if not isinstance(nanny, distributed.Nanny):
        raise TypeError(
            f"{PRELOAD} is a nanny preload (--preload-nanny {PRELOAD}, or `dask-pcm worker`), "
            f"given {type(nanny).__name__} {getattr(nanny, 'address', '')}"
        )
    if config.get("worker.disable-malloc-trim"):
        leaked = nanny.pre_spawn_env.pop(MALLOC_TRIM, None)
        nanny.env.pop(MALLOC_TRIM, None)
        # A plain Nanny started earlier in this process writes its pre-spawn variables
        # into os.environ, where our worker process would inherit them.
        if leaked is not None and os.environ.get(MALLOC_TRIM) == leaked:
            os.environ.pop(MALLOC_TRIM)
    worker_config: dict[str, Any] = {}
    interval = config.get("worker.profile-interval")
    if interval is not None:
        worker_config["distributed.worker.profile.interval"] = interval
    worker_config.update(tick_config())
    if not dask.config.get("pcm.worker.template-directory", None, config=nanny.config):
        shared = os.path.join(nanny.local_directory, TEMPLATES)
        worker_config["pcm.worker.template-directory"] = shared
    # merge copies nested dicts: the nanny's process-wide config stays as it was.
    nanny.config = dask.config.merge(nanny.config, *map(_nested, worker_config.items()))
    _add_worker_preloads(nanny)
    gpu.bind(nanny)


def host_template_directory(local_directory: str | None = None) -> str:
    """The host's template folder of the workers of nannies started here with
    ``local_directory`` (``pcm.worker.template-directory``, else the scratch space's
    ``pcm-templates`` as :func:`dask_setup` gives it), for a client that makes their copy.

    The scratch space is the folder distributed gives such a nanny: ``local_directory`` or
    ``temporary-directory`` or the system's, with ``dask-scratch-space`` appended unless
    named already.
    """
    chosen = config.get("worker.template-directory")
    if chosen:
        return str(chosen)
    return os.path.join(scratch_directory(local_directory), TEMPLATES)


def scratch_directory(local_directory: str | None = None) -> str:
    """The scratch space of a nanny started here with ``local_directory`` (see
    :func:`host_template_directory`)."""
    import tempfile

    base = local_directory or dask.config.get("temporary-directory") or tempfile.gettempdir()
    if SCRATCH not in str(base):
        base = os.path.join(base, SCRATCH)
    return os.path.abspath(base)


def teardown(nanny: distributed.Nanny) -> None:
    """Give back what :func:`setup` claimed for ``nanny`` (its GPU)."""
    gpu.unbind(nanny)


def _nested(item: tuple[str, Any]) -> dict[str, Any]:
    key, value = item
    out: dict[str, Any] = {}
    inner = out
    *parents, last = key.split(".")
    for part in parents:
        inner = inner.setdefault(part, {})
    inner[last] = value
    return out


def _add_worker_preloads(nanny: distributed.Nanny) -> None:
    """Append :data:`WORKER_PRELOADS` to the worker's preloads, their argv kept in step:
    distributed pairs ``preload_argv`` with ``preload`` when it is a list per preload."""
    preloads = nanny.preload
    names = [preloads] if isinstance(preloads, str) else list(preloads or [])
    argv = list(nanny.preload_argv or [])
    per_preload = bool(argv) and not isinstance(argv[0], str)
    added = [name for name in WORKER_PRELOADS if name not in names]
    nanny.preload = [*names, *added]
    if per_preload:
        nanny.preload_argv = [*argv, *([] for _ in added)]


# The nanny preload interface (distributed calls these with the nanny).
def dask_setup(nanny: distributed.Nanny) -> None:
    setup(nanny)


def dask_teardown(nanny: distributed.Nanny) -> None:
    teardown(nanny)


def worker_settings(dask_worker: distributed.Worker | None = None) -> dict[str, Any]:
    """The dask_pcm settings this worker actually has; run it on the workers with
    ``client.run(worker_settings)``.

    Intervals are in seconds, as the worker's periodic callbacks run them;
    ``MALLOC_TRIM_THRESHOLD_`` and ``CUDA_VISIBLE_DEVICES`` are the values in the worker's
    environment, ``None`` where unset; ``preemption-signals`` are those the preemption
    plugin waits for, ``None`` without the plugin.

    Examples
    --------
    >>> settings = client.run(worker_settings)                   # doctest: +SKIP
    >>> {s["MALLOC_TRIM_THRESHOLD_"] for s in settings.values()}  # doctest: +SKIP
    {None}
    """
    worker = dask_worker if dask_worker is not None else distributed.get_worker()
    plugin = worker.plugins.get(preemption.NAME)
    signals = getattr(plugin, "signals", None)
    return {
        "tick-interval": _interval(worker, "tick"),
        "profile-interval": _interval(worker, "profile"),
        MALLOC_TRIM: os.environ.get(MALLOC_TRIM),
        VISIBLE: os.environ.get(VISIBLE),
        "template-directory": config.get("worker.template-directory"),
        "preloads": [preload.name for preload in worker.preloads],
        "preimport-modules": list(config.get("worker.preimport-modules") or []),
        "preemption-signals": None
        if signals is None
        else sorted(signal.Signals(s).name for s in signals),
        "gpu-per-worker": bool(config.get("worker.gpu-per-worker")),
        "nanny": worker.nanny is not None,
    }


def _interval(worker: distributed.Worker, callback: str) -> float | None:
    """Seconds between runs of the worker's periodic callback ``callback``; ``None`` where
    it has none (the profiler switched off)."""
    running = worker.periodic_callbacks.get(callback)
    return None if running is None else float(running.callback_time) / 1000
