"""Resumable embedding of a corpus with a context that is not an LLM: a sentence encoder.

    python examples/embed_corpus.py [--corpus FILE] [--output DIR] [--model PATH]

The encoder folder's whole tree (weights, ``1_Pooling/``, ``tokenizer/``) is copied to every
worker, where the loader builds the encoder once for all tasks. FILE holds lines ``{"id":
..., "text": ...}`` (default: ``--rows`` sentences). Kill the run and rerun it: only units not
yet in the output folder are computed. Pass your encoder folder as ``--model`` (default: a
tiny random one, built offline); for another layout, write a loader like MeanPoolingEncoder.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

import dask_pcm
from dask_pcm.testing import MeanPoolingEncoder, build_tiny_encoder

WORK = Path(tempfile.gettempdir()) / "dask-pcm-examples"
WHO = ["Paris", "Berlin", "The Moon", "The Nile", "Marie Curie", "Water", "Mount Everest"]


def embed_texts(rows: list[dict], context: str = "encoder") -> list[dict]:
    """The task, run on a worker against its resident encoder."""
    vectors = dask_pcm.get_context(context).embed([row["text"] for row in rows])
    return [{"embedding": vector} for vector in vectors]


if __name__ == "__main__":
    cli = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    cli.add_argument("--corpus", type=Path, help="JSON lines with id and text")
    cli.add_argument("--output", type=Path, default=WORK / "embeddings", help="%(default)s")
    cli.add_argument("--model", type=Path, help="default: a tiny random encoder")
    cli.add_argument("--rows", type=int, default=64, help="sentences written without --corpus")
    cli.add_argument("--workers", type=int, help="local worker processes (default: per core)")
    args = cli.parse_args()
    if args.corpus is None:
        args.corpus = WORK / f"corpus-{args.rows}.jsonl"
        args.corpus.parent.mkdir(parents=True, exist_ok=True)
        rows = [{"id": i, "text": f"{WHO[i % 7]} is number {i}."} for i in range(args.rows)]
        args.corpus.write_text("".join(json.dumps(row) + "\n" for row in rows))
    model = args.model or WORK / "tiny-encoder"
    if args.model is None and not (model / "modules.json").exists():
        build_tiny_encoder(model)  # weights, 1_Pooling/, tokenizer/: offline, once
    encoder = dask_pcm.Context("encoder", MeanPoolingEncoder(), template=str(model))

    result = dask_pcm.run_batch(
        embed_texts, args.corpus, contexts=encoder, output=args.output, rows_per_unit=4,
        carry=["text"], workers=args.workers,
    )  # fmt: skip
    units = result.report["units"]
    print(f"units: {units['computed']} computed, {units['reused']} reused of {units['total']}")
    table = result.to_pandas().sort_values("id")
    vectors = np.stack(table["embedding"].to_numpy())
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    print(f"{len(table)} embeddings of dimension {vectors.shape[1]} in {result.output}")
    print(f"nearest to {table['text'].iloc[0]!r} (cosine):")
    for i in np.argsort(-(vectors @ vectors[0]))[1:4]:  # [0] is the query itself
        print(f"  {vectors[i] @ vectors[0]:.3f} {table['text'].iloc[i]!r}")
