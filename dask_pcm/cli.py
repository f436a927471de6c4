"""Command line: ``dask-pcm ...``, also ``dask pcm ...`` through the ``dask_cli`` entry point."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import click
from distributed import Client

from dask_pcm import client as pcm
from dask_pcm.cli_batch import batch
from dask_pcm.cli_shared import SCHEDULER, SCHEDULER_FILE, interruptible, scheduler_client
from dask_pcm.config import LEVELS, default_level
from dask_pcm.context import causal_lm
from dask_pcm.deploy import KINDS
from dask_pcm.deploy.local import local_cluster
from dask_pcm.diagnosis import doctor as examine_workers
from dask_pcm.diagnosis import format_reports
from dask_pcm.exceptions import ClusterLostError, PCMError
from dask_pcm.fever.data import ERRORS
from dask_pcm.fever.run import run_fever
from dask_pcm.fever.scoring import METHODS
from dask_pcm.gpus import visible_gpus
from dask_pcm.loaders.gpu import DTYPES
from dask_pcm.tasks import get_context
from dask_pcm.templates.embedded import embedded_model_dir

DEMO_QUESTIONS = [
    "What is the capital of France?",
    "What is the chemical symbol for water?",
    "How many legs does a spider have?",
    "Which planet is known as the Red Planet?",
    "What language is spoken in Brazil?",
    "Who wrote Romeo and Juliet?",
]


@click.group(name="pcm")
@click.version_option(package_name="dask-pcm")
def main() -> None:
    """dask_pcm: worker-resident LLM contexts for high-throughput inference on Dask."""


main.add_command(batch)


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


def _answer(question: str) -> str:
    lm = get_context("demo")
    return str(lm.complete(lm.chat_prompt(question), max_new_tokens=16)).strip()


@main.command()
@MODEL
@workers(2, "Local worker processes.")
@LEVEL
@click.option("--repeat", default=2, show_default=True, help="Times each question is asked.")
def demo(model: str | None, workers: int, level: str | None, repeat: int) -> None:
    """Register an LLM context on a local cluster and answer questions with it.

    Shows the context mechanism end to end: one load per worker at level full, every
    task served from the resident model, and the status table.
    """
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        with interruptible(None):
            _demo(model, workers, level, repeat)
    except PCMError as exc:
        raise click.ClickException(str(exc)) from exc


def _demo(model: str | None, workers: int, level: str | None, repeat: int) -> None:
    if model is None:
        click.echo("Preparing the embedded SmolLM2-135M-Instruct (converted once, then cached)...")
        embedded_model_dir()
    start = time.perf_counter()
    with local_cluster(n_workers=workers) as cluster, Client(cluster) as client:
        click.echo(f"Cluster: {workers} workers, dashboard {client.dashboard_link}")
        click.echo(f"Contexts: {pcm.status_page(client)}")
        level = level or default_level()
        context = causal_lm(model, name="demo", level=level)
        pcm.register(client, context)
        click.echo(
            f"Context 'demo' ready at level {level} after {time.perf_counter() - start:.1f} s"
        )
        questions = DEMO_QUESTIONS * repeat
        futures = pcm.map(client, _answer, questions, context="demo", pure=False)
        for question, answer in zip(
            questions, client.gather(futures)[: len(DEMO_QUESTIONS)], strict=False
        ):
            click.echo(f"  Q: {question}\n  A: {answer}")
        table = pcm.status(client)
        cols = ["worker", "context", "state", "level", "loads", "load_seconds", "tasks", "device"]
        click.echo("\n" + table[cols].to_string(index=False))
    click.echo(f"\n{len(questions)} tasks in {time.perf_counter() - start:.1f} s")


@main.command()
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
    help="Claims each task scores (default 16).",
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
        _check_writable(json_path, "--json")  # before the run, not after it
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
    from dask_pcm.fever.ranking import HOW_TO_READ, display_table  # pandas, once there is a table

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


@main.command()
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
        _check_writable(json_path, "--json")
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


def _check_writable(path: str, option: str) -> None:
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


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
