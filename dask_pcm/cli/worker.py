"""``dask-pcm worker``: ``dask worker`` with the dask_pcm worker setup.

The command takes every option of distributed's ``dask worker`` (its click parameters,
reused) and starts workers as ``dask worker`` does, with two things added: the nanny preload
:mod:`dask_pcm.deploy.worker_setup` (what every dask_pcm worker gets) and, for the nannies
themselves, ``pcm.tick-interval``. ``python -m dask_pcm.cli.worker`` runs it too.
"""

from __future__ import annotations

import warnings
from typing import Any

import click
import dask.config
from distributed.cli import dask_worker

from dask_pcm.deploy import worker_setup

# `python -m dask_pcm.cli.worker`: runpy imports dask_pcm.cli first, which registers (imports)
# this module, and then warns that it is about to run it again as __main__; harmless.
warnings.filterwarnings(
    "ignore", message="'dask_pcm.cli.worker' found in sys.modules", category=RuntimeWarning
)

HELP = f"""Start dask_pcm workers attached to the scheduler at SCHEDULER.

The same as `dask worker` (every option below is its own), with the dask_pcm worker setup
that dask_pcm.local_cluster and batch_cluster jobs give their workers: no
``MALLOC_TRIM_THRESHOLD_`` in the worker's environment, a coarser profiler and event-loop tick,
one template folder per host, torch and transformers imported as the worker starts, the
preemption plugin (SIGUSR2: retire gracefully), and one GPU per worker process on a host
with GPUs. It is the nanny preload {worker_setup.PRELOAD}, so workers need their nanny
(no --no-nanny).

\b
Example:
    dask-pcm worker tcp://scheduler:8786 --nworkers 2 --nthreads 1
"""


def _start(**params: Any) -> None:
    if not params["nanny"]:
        raise click.UsageError(
            f"the dask_pcm worker setup runs in the nanny ({worker_setup.PRELOAD}): "
            "leave out --no-nanny"
        )
    params["preload_nanny"] = worker_setup.with_nanny_preload(params["preload_nanny"])
    # The nannies read the tick as they start (their workers get theirs from the preload).
    with dask.config.set(worker_setup.tick_config()):
        dask_worker.main.callback(**params)  # type: ignore[misc]


# distributed's own --version (distributed's version) would be taken for dask_pcm's.
worker = click.Command(
    name="worker",
    callback=_start,
    params=[p for p in dask_worker.main.params if p.name != "version"],
    help=HELP,
    short_help="Start workers (`dask worker`) with the dask_pcm worker setup.",
    context_settings=dict(dask_worker.main.context_settings),
)

if __name__ == "__main__":  # pragma: no cover - `python -m dask_pcm.cli.worker`
    worker()
