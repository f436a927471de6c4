"""``dask-pcm fever``: prompt templates ranked for an LLM as a FEVER fact checker
(:func:`dask_pcm.run_fever`)."""

from __future__ import annotations

import json
import logging
from typing import Any

import click

from dask_pcm.apps.fever.data import ERRORS
from dask_pcm.apps.fever.run import CLAIMS_PER_TASK, run_fever
from dask_pcm.apps.fever.scoring import METHODS
from dask_pcm.cli.shared import (
    ENGINE,
    LEVEL,
    MODEL,
    SCHEDULER,
    SCHEDULER_FILE,
    check_writable,
    interruptible,
    pd_options,
    scheduler_client,
    workers,
)
from dask_pcm.deploy import KINDS
from dask_pcm.exceptions import ClusterLostError, PCMError


@click.command()
@click.option(
    "--data", type=click.Path(dir_okay=False), help="FEVER JSON lines (default: a small demo set)."
)
@MODEL
@click.option(
    "--templates",
    default=None,
    help="Built-in template names 'a,b' or a template file (default: all built-ins).",
)
@click.option("--num-templates", type=int, default=None, help="Keep the first N templates.")
@LEVEL
@click.option(
    "--claims-per-task",
    type=click.IntRange(min=1),
    default=None,
    help=f"Claims each task scores (default {CLAIMS_PER_TASK}).",
)
@click.option(
    "--batch-size", type=click.IntRange(min=1), hidden=True, help="Old name of --claims-per-task."
)
@click.option(
    "--prefix-cache/--no-prefix-cache",
    default=None,
    help="Keep each template's text before the claim as key/value states on the workers "
    "(default: on; the same predictions, faster).",
)
@click.option("--limit", type=int, default=None, help="Score a stratified sample of N claims.")
@click.option(
    "--method", type=click.Choice(METHODS), default=None, help="Scoring (default logits)."
)
@click.option(
    "--output",
    type=click.Path(),
    default=None,
    help="Folder of Parquet predictions; rerunning resumes.",
)
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write summary and report as JSON.",
)
@click.option(
    "--errors",
    type=click.Choice(ERRORS),
    default=None,
    help="Malformed FEVER lines and claims whose prompt cannot fit the model: raise (default: "
    "stop before any work, naming file:line) or skip (count them, record such prompts as "
    "error rows, go on).",
)
@click.option(
    "--truncate/--no-truncate",
    default=None,
    help="Cut claims whose prompt cannot fit the model until it fits (counted; default: "
    "pcm.fever.truncate, off).",
)
@click.option(
    "--cluster",
    type=click.Choice(["local", *KINDS]),
    default="local",
    show_default=True,
    help="Where workers run: local processes, or Grid Engine / HTCondor jobs "
    "(dask-jobqueue configuration: jobqueue.sge / jobqueue.htcondor).",
)
@workers(
    None,
    "Local worker processes (default: one per GPU, else one per core), or the most worker "
    "jobs (default 4).",
)
@ENGINE
@SCHEDULER
@SCHEDULER_FILE
def fever(
    json_path: str | None, scheduler: str | None, scheduler_file: str | None, **options: Any
) -> None:
    """Rank prompt templates for an LLM as a FEVER fact checker.

    Prints one row per template, best first: accuracy with its 95 % interval, number of
    claims, macro-F1, the recall of each label, accuracy and macro-F1 with each template's
    label bias removed, and the p-value of the difference from the best template.
    """
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if json_path:
        check_writable(json_path, "--json")  # before the run, not after it
    given = {k: v for k, v in options.items() if v is not None}  # run_fever has the defaults
    kept = (
        f"finished units are in {given['output']}; run the same command again to resume"
        if "output" in given
        else "the results were not kept (--output DIR keeps them)"
    )
    try:
        with (
            interruptible(kept),
            scheduler_client(
                scheduler, scheduler_file, options["cluster"], options["workers"]
            ) as client,
        ):
            result = run_fever(**{**given, "cluster": client or options["cluster"]})
    except ClusterLostError as exc:
        raise click.ClickException(f"{exc}; {kept}") from exc
    except (PCMError, ValueError, OSError) as exc:
        raise click.ClickException(str(exc)) from exc
    from dask_pcm.apps.fever.ranking import (  # pandas, once there is a table
        HOW_TO_READ,
        display_table,
    )

    with pd_options():
        click.echo(display_table(result.summary).to_string(index=False))
    click.echo(f"\n{HOW_TO_READ}")
    report = result.report
    units = report["units"]
    click.echo(
        f"\n{report['claims']} claims x {result.summary.shape[0]} templates; "
        f"{units['computed']} units computed in {report['tasks']} tasks, {units['reused']} "
        f"reused; {report['wall_seconds']:.1f} s"
        + (f"; {report['files']} files in {result.output}" if result.output else "")
    )
    if report["row_errors"]:
        click.echo(
            f"{report['row_errors']} row(s) recorded as errors, without a prediction "
            "(column 'error'), e.g.:\n  " + "\n  ".join(report["row_error_examples"])
        )
    if report["truncated"]:
        click.echo(f"{report['truncated']} prompt(s) scored with their claim cut to fit")
    if json_path:
        payload = {"summary": result.summary.to_dict("records"), "report": report}
        try:
            with open(json_path, "w") as f:
                json.dump(payload, f, indent=2, default=str)
        except OSError as exc:
            raise click.ClickException(
                f"--json {json_path}: cannot write the report: {exc}"
            ) from exc
        click.echo(f"summary and report written to {json_path}")
