"""Command line: ``dask-pcm ...``, also ``dask pcm ...`` through the ``dask_cli`` entry point.

One module per command; the options and helpers more than one command takes are in
:mod:`dask_pcm.cli.shared`.
"""

from __future__ import annotations

import click

from dask_pcm.cli.demo import demo
from dask_pcm.cli.doctor import doctor
from dask_pcm.cli.fever import fever
from dask_pcm.cli.openai_batch import batch
from dask_pcm.cli.worker import worker


@click.group(name="pcm")
@click.version_option(package_name="dask-pcm")
def main() -> None:
    """dask_pcm: worker-resident LLM contexts for high-throughput inference on Dask."""


for _command in (demo, fever, batch, doctor, worker):
    main.add_command(_command)

__all__ = ["main"]
