"""Resumable retrieval: the top-k passages of each query from a FAISS index and an encoder.

    python examples/retrieve_faiss.py [--queries N] [--k K] [--output DIR] [--index DIR]

One context holds both halves of a retrieval system: its template is a folder with
``index.faiss`` (inner-product index of the passages' vectors), ``passages.jsonl`` and an
``encoder/`` folder (with subfolders of its own). Every worker gets the whole tree, peer to
peer, and builds index and encoder once; each task embeds its queries and searches the
index. Without ``--index`` a tiny random encoder and an index of ``--passages`` sentences are
built offline, once. Kill the run and rerun it: only units not yet in the output folder are
computed. Needs ``faiss-cpu`` (``pip install -e ".[examples]"``).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import dask_pcm
from dask_pcm.testing import MeanPoolingEncoder, build_tiny_encoder

WORK = Path(tempfile.gettempdir()) / "dask-pcm-examples"
WHO = ["Paris", "Berlin", "The Moon", "The Nile", "Marie Curie", "Water", "Mount Everest"]
WHAT = ["is old", "is large", "is far", "is known", "is bright", "is cold", "is high"]


@dataclass(frozen=True)
class Retriever:
    """The loader: the index, the passages' ids and the encoder, from a local copy."""

    def __call__(self, location: str) -> dict:
        import faiss

        root = Path(location)
        ids = [json.loads(line)["id"] for line in (root / "passages.jsonl").open()]
        return {
            "index": faiss.read_index(str(root / "index.faiss")),
            "ids": ids,
            "encoder": MeanPoolingEncoder()(str(root / "encoder")),
        }


def top_k(rows: list[dict], k: int = 5, context: str = "retriever") -> list[dict]:
    """The task: the ``k`` nearest passages of each query (ids and inner products)."""
    held = dask_pcm.get_context(context)
    vectors = np.asarray(held["encoder"].embed([row["text"] for row in rows]), dtype="float32")
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    scores, found = held["index"].search(vectors, k)
    return [
        {"passages": [held["ids"][j] for j in hits], "scores": [float(s) for s in near]}
        for hits, near in zip(found, scores, strict=True)
    ]


def build_index(folder: Path, passages: int) -> Path:
    """A template folder: a tiny encoder, ``passages`` sentences and their FAISS index."""
    import faiss

    folder.mkdir(parents=True, exist_ok=True)
    encoder_dir = build_tiny_encoder(folder / "encoder")
    texts = [f"{WHO[i % 7]} {WHAT[(i // 7) % 7]}, passage {i}." for i in range(passages)]
    vectors = np.asarray(MeanPoolingEncoder()(str(encoder_dir)).embed(texts), dtype="float32")
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    index = faiss.IndexFlatIP(vectors.shape[1])
    index.add(vectors)
    faiss.write_index(index, str(folder / "index.faiss"))
    lines = (json.dumps({"id": f"p{i}", "text": t}) + "\n" for i, t in enumerate(texts))
    (folder / "passages.jsonl").write_text("".join(lines))
    return folder


if __name__ == "__main__":
    cli = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    cli.add_argument("--queries", type=int, default=10_000, help="%(default)s")
    cli.add_argument("--k", type=int, default=5, help="neighbours per query (%(default)s)")
    cli.add_argument("--output", type=Path, default=WORK / "neighbours", help="%(default)s")
    cli.add_argument("--index", type=Path, help="a template folder in this layout")
    cli.add_argument("--passages", type=int, default=2_000, help="passages built without --index")
    cli.add_argument("--workers", type=int, help="local worker processes (default: per core)")
    args = cli.parse_args()
    folder = args.index or WORK / f"retrieval-{args.passages}"
    if args.index is None and not (folder / "index.faiss").exists():
        build_index(folder, args.passages)
    queries = WORK / f"queries-{args.queries}.jsonl"
    queries.parent.mkdir(parents=True, exist_ok=True)
    rows = [{"id": i, "text": f"Where is {WHO[i % 7]}? ({i})"} for i in range(args.queries)]
    queries.write_text("".join(json.dumps(row) + "\n" for row in rows))
    retriever = dask_pcm.Context("retriever", Retriever(), template=str(folder))

    result = dask_pcm.run_batch(
        top_k, queries, contexts=retriever, output=args.output, rows_per_unit=4,
        carry=["text"], workers=args.workers, k=args.k,
    )  # fmt: skip
    units = result.report["units"]
    print(f"units: {units['computed']} computed, {units['reused']} reused of {units['total']}")
    table = result.to_pandas().sort_values("id")
    print(f"{len(table)} queries, {args.k} neighbours each, in {result.output}")
    first = table.iloc[0]
    print(f"{first['text']!r} -> {list(first['passages'])[:3]}")
