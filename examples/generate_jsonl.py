"""Resumable text generation over a JSON-lines file of prompts, with the built-in task.

    python examples/generate_jsonl.py [--prompts FILE] [--output DIR] [--model PATH]

FILE holds lines ``{"id": ..., "prompt": "..."}`` (by default ``--rows`` prompts are
written). Answers are appended to the output folder unit by unit: kill the run, start the
same command again, and only the units not yet on disk are computed. Pass your model's
folder (or ``.gguf`` file) as ``--model``; by default a tiny random Llama is built offline,
so the answers are nonsense but the run is real.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import dask_pcm
from dask_pcm.apps.llm import generate

WORK = Path(tempfile.gettempdir()) / "dask-pcm-examples"
CITIES = ["Paris", "Rome", "Berlin", "Madrid", "Lisbon", "Vienna", "Oslo", "Athens"]

if __name__ == "__main__":
    cli = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    cli.add_argument("--prompts", type=Path, help="JSON lines with id and prompt")
    cli.add_argument("--output", type=Path, default=WORK / "answers", help="%(default)s")
    cli.add_argument("--model", default=None, help="default: a tiny random Llama")
    cli.add_argument("--rows", type=int, default=64, help="prompts written without --prompts")
    cli.add_argument("--workers", type=int, help="local worker processes (default: per core)")
    args = cli.parse_args()
    if args.prompts is None:
        args.prompts = WORK / f"prompts-{args.rows}.jsonl"
        args.prompts.parent.mkdir(parents=True, exist_ok=True)
        rows = [{"id": i, "prompt": f"Tell me about {CITIES[i % 8]}:"} for i in range(args.rows)]
        args.prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    model = args.model or dask_pcm.build_tiny_llama(WORK / "tiny-llama")  # reused once built

    result = dask_pcm.run_batch(
        generate,  # runs on the workers, against the resident model named "llm"
        args.prompts,
        contexts=dask_pcm.causal_lm(model, name="llm"),
        output=args.output,
        rows_per_unit=4,  # the grain of a resume (tasks pack several units)
        carry=["prompt"],
        workers=args.workers,
        max_tokens=12,  # generate's keyword arguments, recorded in the folder
    )
    units = result.report["units"]
    print(f"units: {units['computed']} computed, {units['reused']} reused of {units['total']}")
    answers = result.to_pandas().sort_values("id")
    print(f"{len(answers)} answers in {result.output}, the first:")
    for row in answers.head(3).itertuples():
        print(f"  {row.id}: {row.prompt!r} -> {row.text!r} ({row.finish_reason})")
