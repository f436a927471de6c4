"""``dask-pcm batch``: an OpenAI Batch API input file answered on a Dask cluster
(:mod:`dask_pcm.apps.openai_batch`)."""

from __future__ import annotations

import json
import logging

import click

from dask_pcm.apps.openai_batch import parse_window, read_status, run_requests
from dask_pcm.cli.shared import (
    ENGINE,
    SCHEDULER,
    SCHEDULER_FILE,
    echo_lines,
    interruptible,
    scheduler_client,
)
from dask_pcm.config import LEVELS
from dask_pcm.deploy import KINDS
from dask_pcm.exceptions import ClusterLostError, PCMError


@click.command()
@click.option(
    "-i",
    "--input",
    "requests",
    type=click.Path(exists=True, dir_okay=False),
    help="Requests as the OpenAI Batch API takes them: custom_id, method, url, body per line.",
)
@click.option(
    "-o",
    "--output",
    type=click.Path(file_okay=False),
    help="Folder for output.jsonl, errors.jsonl and batch.json; running again resumes.",
)
@click.option(
    "--status",
    "status_of",
    type=click.Path(exists=True, file_okay=False),
    default=None,
    help="Print the Batch object (batch.json) of this output folder and exit.",
)
@click.option("--model", default=None, help="HF directory, .gguf file or hub id (default: "
              "embedded SmolLM2-135M-Instruct).")  # fmt: skip
@click.option(
    "--served-model-name",
    default=None,
    help="The model the responses name and requests must ask for (default: the model's "
    "folder or file name).",
)
@click.option(
    "--any-model",
    is_flag=True,
    help="Answer every request with the served model, whatever model it names (default: "
    "a request for another model is a 404 model_not_found).",
)
@click.option(
    "--completion-window",
    default=None,
    help="How long the run may take (24h, 90m, 3600s); requests not run by then end as "
    "batch_expired, and running again answers them. Default: no limit.",
)
@click.option(
    "--errors",
    type=click.Choice(["raise", "skip"]),
    default="raise",
    show_default=True,
    help="Lines that are no request: stop before any work, naming file:line, or skip them "
    "(counted).",
)
@click.option(
    "--cluster",
    type=click.Choice(["local", *KINDS]),
    default="local",
    show_default=True,
    help="Where workers run: local processes, or batch jobs (dask-jobqueue configuration).",
)
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=None,
    help="Local worker processes (default: one per GPU, else per core), or the most jobs (4).",
)
@SCHEDULER
@SCHEDULER_FILE
@click.option(
    "--requests-per-unit",
    type=click.IntRange(min=1),
    default=16,
    show_default=True,
    help="Requests per unit: the grain of a resume and of a failure.",
)
@click.option("--level", type=click.Choice(LEVELS), default=None, help="Context level.")
@ENGINE
def batch(
    requests: str | None,
    output: str | None,
    status_of: str | None,
    model: str | None,
    served_model_name: str | None,
    any_model: bool,
    completion_window: str | None,
    errors: str,
    cluster: str,
    workers: int | None,
    scheduler: str | None,
    scheduler_file: str | None,
    requests_per_unit: int,
    level: str | None,
    engine: str,
) -> None:
    """Answer an OpenAI Batch API file: chat completions, completions, responses and
    embeddings.

    Writes OUTPUT/output.jsonl (answers) and OUTPUT/errors.jsonl (requests that failed),
    in the Batch API's format and input order, and OUTPUT/batch.json (the Batch object:
    status, counts, usage; --status OUTPUT prints it). Interrupted or killed, the same
    command answers only what is missing.
    """
    if status_of is not None:
        try:
            click.echo(json.dumps(read_status(status_of), indent=2))
        except (OSError, ValueError) as exc:
            raise click.ClickException(str(exc)) from exc
        return
    if not requests or not output:
        raise click.UsageError("give -i/--input and -o/--output (or --status DIR)")
    try:
        parse_window(completion_window)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--completion-window") from None
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    kept = f"answered units are in {output}; run the same command again to resume"
    try:
        with (
            interruptible(kept),
            scheduler_client(scheduler, scheduler_file, cluster, workers) as client,
        ):
            outcome = run_requests(
                requests, output, model=model, served_model_name=served_model_name,
                any_model=any_model, cluster=client or cluster, workers=workers,
                errors=errors, requests_per_unit=requests_per_unit, level=level,
                completion_window=completion_window, engine=engine,
            )  # fmt: skip
    except ClusterLostError as exc:
        raise click.ClickException(f"{exc}; {kept}") from exc
    except (PCMError, ValueError, OSError) as exc:
        raise click.ClickException(str(exc)) from exc
    if outcome.skipped:
        click.echo(f"Skipped {outcome.skipped} line(s) that are no request:", err=True)
        echo_lines(outcome.problems, 5, "lines")
    if outcome.status == "expired":
        click.echo(
            f"The completion window ({completion_window}) ended first: the requests not run "
            "are batch_expired in the errors file; run the same command again to answer them.",
            err=True,
        )
    click.echo(
        f"{outcome.succeeded} succeeded, {outcome.failed} failed, {outcome.skipped} skipped "
        f"line(s); answers in {outcome.output}, errors in {outcome.errors}"
    )
