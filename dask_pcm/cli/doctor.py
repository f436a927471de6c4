"""``dask-pcm doctor``: what each worker's GPU (or CPU) and torch make of a context."""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import asdict
from typing import Any

import click
from distributed import Client

from dask_pcm.cli.shared import MODEL, check_writable
from dask_pcm.deploy.local import local_cluster
from dask_pcm.diagnosis import doctor as examine_workers
from dask_pcm.diagnosis import format_reports
from dask_pcm.engine.gpu import DTYPES
from dask_pcm.exceptions import PCMError
from dask_pcm.gpus import visible_gpus


@click.command()
@MODEL
@click.option(
    "--scheduler",
    default=None,
    help="Examine the workers of this running scheduler (default: start local ones).",
)
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=None,
    help="Local worker processes (default: one per GPU, else one).",
)
@click.option("--device", default="auto", show_default=True, help="As for CausalLM.")
@click.option("--dtype", type=click.Choice(DTYPES), default="auto", show_default=True)
@click.option("--no-compare", is_flag=True, help="Skip the comparison with CPU float32.")
@click.option(
    "--json", "json_path", type=click.Path(dir_okay=False), help="Also write the reports as JSON."
)
def doctor(
    model: str | None,
    scheduler: str | None,
    workers: int | None,
    device: str,
    dtype: str,
    no_compare: bool,
    json_path: str | None,
) -> None:
    """Check what each worker's GPU (or CPU) and torch make of a context.

    Per worker: device, compute capability, dtype, free memory, driver and CUDA versions,
    the batch size it chooses, one forward pass against CPU float32, and advice where
    something is off. Exits with status 1 when a worker cannot load the model.
    """
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if json_path:
        check_writable(json_path, "--json")
    options: dict[str, Any] = {
        "model": model,
        "device": device,
        "dtype": dtype,
        "compare": not no_compare,
    }
    try:
        if scheduler:
            with Client(scheduler) as client:
                reports = examine_workers(client, **options)
        else:
            count = workers or len(visible_gpus()) or 1
            with local_cluster(n_workers=count) as cluster, Client(cluster) as client:
                client.wait_for_workers(count)
                reports = examine_workers(client, **options)
    except (PCMError, ValueError, OSError) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(format_reports(reports))
    if json_path:
        with open(json_path, "w") as f:
            json.dump([asdict(r) for r in reports], f, indent=2)
    if any(r.error for r in reports):
        sys.exit(1)
