"""Command line: ``dask-pcm ...``, also ``dask pcm ...`` through the ``dask_cli`` entry point."""

from __future__ import annotations

import logging
import sys
import time

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
@click.option("--workers", default=2, show_default=True, help="Local worker processes.")
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

    import dask_pcm

    if model is None:
        click.echo("Preparing the embedded SmolLM2-135M-Instruct (converted once, then cached)...")
        dask_pcm.embedded_model_dir()
    start = time.perf_counter()
    with dask_pcm.local_cluster(n_workers=workers) as cluster, Client(cluster) as client:
        click.echo(f"Cluster: {workers} workers, dashboard {client.dashboard_link}")
        context = dask_pcm.causal_lm(model, name="demo", level=level)
        dask_pcm.register(client, context)
        click.echo(
            f"Context 'demo' ready at level {level} after {time.perf_counter() - start:.1f} s"
        )
        questions = DEMO_QUESTIONS * repeat
        futures = dask_pcm.map(client, _answer, questions, context="demo", pure=False)
        for question, answer in zip(
            questions, client.gather(futures)[: len(DEMO_QUESTIONS)], strict=False
        ):
            click.echo(f"  Q: {question}\n  A: {answer}")
        table = dask_pcm.status(client)
        cols = ["worker", "context", "state", "level", "loads", "load_seconds", "tasks", "device"]
        click.echo("\n" + table[cols].to_string(index=False))
    click.echo(f"\n{len(questions)} tasks in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
