"""``dask-pcm demo``: an LLM context registered on a local cluster, answering questions."""

from __future__ import annotations

import logging
import time

import click
from distributed import Client

from dask_pcm import client as pcm
from dask_pcm.cli.shared import LEVEL, MODEL, interruptible, workers
from dask_pcm.config import default_level
from dask_pcm.context import causal_lm
from dask_pcm.deploy.local import local_cluster
from dask_pcm.exceptions import PCMError
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


def _answer(question: str) -> str:
    lm = get_context("demo")
    return str(lm.complete(lm.chat_prompt(question), max_new_tokens=16)).strip()


@click.command()
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
