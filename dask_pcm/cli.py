"""Command line: ``dask-pcm ...``, also ``dask pcm ...`` through the ``dask_cli`` entry point."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import click

from dask_pcm.exceptions import PCMError

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


def _answer(question: str) -> str:
    from dask_pcm.tasks import get_context

    lm = get_context("demo")
    return str(lm.complete(lm.chat_prompt(question), max_new_tokens=16)).strip()


@main.command()
@click.option(
    "--model",
    default=None,
    help="HF directory, .gguf file or hub id (default: embedded SmolLM2-135M-Instruct).",
)
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="Local worker processes.",
)
@click.option(
    "--level", type=click.Choice(["full", "partial", "agnostic"]), default="full", show_default=True
)
@click.option("--repeat", default=2, show_default=True, help="Times each question is asked.")
def demo(model: str | None, workers: int, level: str, repeat: int) -> None:
    """Register an LLM context on a local cluster and answer questions with it.

    Shows the context mechanism end to end: one load per worker at level full, every
    task served from the resident model, and the status table.
    """
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        _demo(model, workers, level, repeat)
    except PCMError as exc:
        raise click.ClickException(str(exc)) from exc


def _demo(model: str | None, workers: int, level: str, repeat: int) -> None:
    from distributed import Client

    from dask_pcm import client as pcm
    from dask_pcm.context import causal_lm
    from dask_pcm.deploy.local import local_cluster
    from dask_pcm.loaders.embedded import embedded_model_dir

    if model is None:
        click.echo("Preparing the embedded SmolLM2-135M-Instruct (converted once, then cached)...")
        embedded_model_dir()
    start = time.perf_counter()
    with local_cluster(n_workers=workers) as cluster, Client(cluster) as client:
        click.echo(f"Cluster: {workers} workers, dashboard {client.dashboard_link}")
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
@click.option(
    "--model",
    default=None,
    help="HF directory, .gguf file or hub id (default: embedded SmolLM2-135M-Instruct).",
)
@click.option(
    "--templates",
    default=None,
    help="Built-in template names 'a,b' or a template file (default: all built-ins).",
)
@click.option("--num-templates", type=int, default=None, help="Keep the first N templates.")
@click.option(
    "--level", type=click.Choice(["full", "partial", "agnostic"]), default="full", show_default=True
)
@click.option("--batch-size", type=int, default=16, show_default=True, help="Claims per task.")
@click.option("--limit", type=int, default=None, help="Score a stratified sample of N claims.")
@click.option(
    "--method", type=click.Choice(["logits", "generate"]), default="logits", show_default=True
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
    type=click.Choice(["raise", "skip"]),
    default="raise",
    show_default=True,
    help="Malformed FEVER lines.",
)
@click.option(
    "--cluster",
    type=click.Choice(["local", "sge", "htcondor"]),
    default="local",
    show_default=True,
    help="Where workers run: local processes, or Grid Engine / HTCondor jobs "
    "(dask-jobqueue configuration: jobqueue.sge / jobqueue.htcondor).",
)
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=None,
    help="Local worker processes (default: one per core), or the most worker jobs (default 4).",
)
def fever(json_path: str | None, **options: Any) -> None:
    """Rank prompt templates for an LLM as a FEVER fact checker.

    Prints one row per template, best first: accuracy, number of claims, macro-F1 and the
    recall of each label.
    """
    import json

    from dask_pcm.fever.run import run_fever

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if json_path:
        _check_writable(json_path, "--json")  # before the run, not after it
    try:
        result = run_fever(**options)
    except (PCMError, ValueError, OSError) as exc:
        raise click.ClickException(str(exc)) from exc
    with pd_options():
        click.echo(result.summary.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    report = result.report
    units = report["units"]
    click.echo(
        f"\n{report['claims']} claims x {result.summary.shape[0]} templates; "
        f"{units['computed']} units computed, {units['reused']} reused; "
        f"{report['wall_seconds']:.1f} s"
    )
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


def _check_writable(path: str, option: str) -> None:
    """Create the parent folders of ``path`` and check a file can be written there."""
    import os
    from pathlib import Path

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
