"""Resumable embeddings with a sentence-transformers model, by dask_pcm's built-in ``embed``
task or by a function of your own.

    python examples/embed_sentence_transformers.py [--task builtin|own] [--output DIR]
        [--model DIR] [--corpus FILE]

The context's template is the model's folder as ``SentenceTransformer.save`` writes it
(``modules.json``, ``1_Pooling/``...), copied whole to every worker, where the loader builds
the model once. ``--task builtin`` runs :func:`dask_pcm.apps.llm.embed` (it uses the
model's own ``encode``); ``--task own`` runs ``my_embed`` below. Without ``--model`` a tiny
random model is built offline, once. Kill the run and rerun it: only units not yet in the
output folder are computed. Needs ``sentence-transformers`` (``pip install -e ".[examples]"``).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import dask_pcm
from dask_pcm.apps.llm import embed
from dask_pcm.testing import build_tiny_sentence_transformer

WORK = Path(tempfile.gettempdir()) / "dask-pcm-examples"
WHO = ["Paris", "Berlin", "The Moon", "The Nile", "Marie Curie", "Water", "Mount Everest"]


def load_sentence_transformer(location: str):
    """The loader: the model in the worker's copy of its folder, on the CPU."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(location, device="cpu")


def my_embed(rows: list[dict], context: str = "st") -> list[dict]:
    """A function of your own: the vector and its length before normalising."""
    model = dask_pcm.get_context(context)
    vectors = model.encode([row["text"] for row in rows], convert_to_numpy=True)
    return [{"embedding": v.tolist(), "norm": float((v**2).sum() ** 0.5)} for v in vectors]


if __name__ == "__main__":
    cli = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    cli.add_argument("--task", choices=["builtin", "own"], default="builtin")
    cli.add_argument("--corpus", type=Path, help="JSON lines with id and text")
    cli.add_argument("--output", type=Path, help="default: st-embeddings-TASK in the temp dir")
    cli.add_argument("--model", type=Path, help="default: a tiny random model")
    cli.add_argument("--rows", type=int, default=64, help="sentences written without --corpus")
    cli.add_argument("--workers", type=int, help="local worker processes (default: per core)")
    args = cli.parse_args()
    output = args.output or WORK / f"st-embeddings-{args.task}"
    if args.corpus is None:
        args.corpus = WORK / f"corpus-{args.rows}.jsonl"
        args.corpus.parent.mkdir(parents=True, exist_ok=True)
        rows = [{"id": i, "text": f"{WHO[i % 7]} is number {i}."} for i in range(args.rows)]
        args.corpus.write_text("".join(json.dumps(row) + "\n" for row in rows))
    model = args.model or WORK / "tiny-sentence-transformer"
    if args.model is None and not (model / "modules.json").exists():
        build_tiny_sentence_transformer(model)
    st = dask_pcm.Context("st", load_sentence_transformer, template=str(model))

    fn, options = (embed, {"context": "st"}) if args.task == "builtin" else (my_embed, {})
    result = dask_pcm.run_batch(
        fn, args.corpus, contexts=st, output=output, rows_per_unit=4, carry=["text"],
        workers=args.workers, **options,
    )  # fmt: skip
    units = result.report["units"]
    print(f"units: {units['computed']} computed, {units['reused']} reused of {units['total']}")
    table = result.to_pandas().sort_values("id")
    print(f"{len(table)} embeddings of dimension {len(table['embedding'].iloc[0])} in {output}")
