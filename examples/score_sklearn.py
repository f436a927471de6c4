"""Resumable scoring of a CSV with a scikit-learn model saved by joblib (a one-file template).

    python examples/score_sklearn.py [--data FILE.csv] [--output DIR] [--model FILE.joblib]

The context's template is one file, ``model.joblib``: each worker gets its own copy, peer to
peer, and unpickles the model once; each task scores its rows' feature columns. Without
``--model`` a logistic regression is trained on a synthetic data set and saved, once;
without ``--data`` a CSV of ``--rows`` rows is written. Kill the run and rerun it: only units
not yet in the output folder are computed. Needs ``scikit-learn``
(``pip install -e ".[examples]"``).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

import dask_pcm

WORK = Path(tempfile.gettempdir()) / "dask-pcm-examples"
FEATURES = ["x0", "x1", "x2", "x3"]


def load_joblib(location: str):
    """The loader: the model in the worker's copy of the file."""
    import joblib

    return joblib.load(location)


def score(rows: list[dict], context: str = "classifier") -> list[dict]:
    """The task: each row's predicted class and its probability."""
    model = dask_pcm.get_context(context)
    features = np.array([[row[name] for name in FEATURES] for row in rows], dtype=float)
    probabilities = model.predict_proba(features)
    return [{"predicted": int(p.argmax()), "probability": float(p.max())} for p in probabilities]


def train(path: Path) -> Path:
    """A logistic regression on a synthetic two-class problem, saved with joblib."""
    import joblib
    from sklearn.linear_model import LogisticRegression

    rng = np.random.default_rng(0)
    x = rng.normal(size=(500, len(FEATURES)))
    y = (x @ np.array([1.5, -2.0, 0.5, 1.0]) > 0).astype(int)
    path.parent.mkdir(parents=True, exist_ok=True)
    joblib.dump(LogisticRegression().fit(x, y), path)
    return path


if __name__ == "__main__":
    cli = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    cli.add_argument("--data", type=Path, help="a CSV with columns id, x0..x3")
    cli.add_argument("--output", type=Path, default=WORK / "scores", help="%(default)s")
    cli.add_argument("--model", type=Path, help="default: a model trained here, once")
    cli.add_argument("--rows", type=int, default=2_000, help="rows written without --data")
    cli.add_argument("--workers", type=int, help="local worker processes (default: per core)")
    args = cli.parse_args()
    model = args.model or WORK / "classifier.joblib"
    if args.model is None and not model.exists():
        train(model)
    if args.data is None:
        import pandas as pd

        args.data = WORK / f"rows-{args.rows}.csv"
        values = np.random.default_rng(1).normal(size=(args.rows, len(FEATURES))).round(6)
        frame = pd.DataFrame(values, columns=FEATURES)
        frame.insert(0, "id", range(args.rows))
        frame.to_csv(args.data, index=False)
    classifier = dask_pcm.Context("classifier", load_joblib, template=str(model))

    result = dask_pcm.run_batch(
        score, args.data, contexts=classifier, output=args.output, rows_per_unit=4,
        workers=args.workers,
    )  # fmt: skip
    units = result.report["units"]
    print(f"units: {units['computed']} computed, {units['reused']} reused of {units['total']}")
    table = result.to_pandas()
    print(f"{len(table)} rows scored in {result.output}; class 1: {table['predicted'].mean():.2f}")
