"""Batch sizes (RQ2): claims per task from 1 to 64 at context levels partial and full.

The same N FEVER claims (default 128, ``--quick`` 16), the same prompt and scoring task as
``levels.py`` (``_harness.score_batch``: one-token answers True/False/Unknown, the embedded
SmolLM2-135M-Instruct by default), cut into tasks of 1, 2, 4, 8, 16, 32 and 64 claims
(``--quick``: 1, 4, 16). Per level a fresh ``dask_pcm.local_cluster`` (2 workers x 1 thread by
default) and one ``register``; then every batch size in turn on that cluster. At ``full`` the
model stays resident through all sizes (the run stops if it was loaded again); at ``partial``
every task builds it from the worker-local template copy, so small batches pay one build for
few claims.

Outside all timings, per cluster: a first model load in each worker before ``register`` (then
released: imports, as in ``levels.py``), ``register`` itself, and one untimed round of one task
of 8 claims per worker (a worker's first forward passes are slower than later ones).

Per row:

- ``wall_s``: from submitting the tasks of that size to having every result; ``claims/s`` is
  N / ``wall_s``.
- task seconds (min, median, p90, max): from Dask's task stream (``distributed.get_task_stream``),
  the ``compute`` interval of each task on its worker. It covers the whole task, so at
  ``partial`` it includes building the model from the local copy and releasing it; p90 is
  numpy's linear interpolation.
- ``loads``: model loads during the row, from ``dask_pcm.status`` (one per task at partial,
  none at full).
- ``cpu``: CPU seconds of the worker processes during ``wall_s`` over workers x ``wall_s``;
  well below 1.0, other work on this shared machine took the cores and the row is inflated
  (or a worker sat idle: fewer tasks than workers, or the tail of the last round).

The batch size is claims per task, the paper's sense. The forward pass itself is capped by
``LanguageModel.batch_size`` (8 prompts on a CPU worker): a task of 64 claims runs 8 passes.
N should be a multiple of the largest size times the workers (128 = 64 x 2), or the last round
leaves a worker idle; with few large tasks (2 of 64 by default), the slower sets the wall time.
Both levels must give the same predictions at every batch size, or the run stops.

Examples::

    python benchmarks/batch_sizes.py --quick
    python benchmarks/batch_sizes.py --json /tmp/batch-sizes.json
    python benchmarks/batch_sizes.py --claims 512 --sizes 8,64 --levels full
"""

from __future__ import annotations

import os
import time

import _harness as h
import numpy as np
from distributed import Client, get_task_stream

import dask_pcm
from dask_pcm import config

COLUMNS = [
    ("level", "level", ""),
    ("batch_size", "batch", "d"),
    ("tasks", "tasks", "d"),
    ("loads", "loads", "d"),
    ("wall_seconds", "wall_s", ".2f"),
    ("claims_per_second", "claims/s", ".2f"),
    ("task_min_seconds", "task_min", ".2f"),
    ("task_median_seconds", "task_med", ".2f"),
    ("task_p90_seconds", "task_p90", ".2f"),
    ("task_max_seconds", "task_max", ".2f"),
    ("cpu_share", "cpu", ".2f"),
]


def _loads(client: Client) -> tuple[int, int]:
    table = dask_pcm.status(client, [h.CONTEXT])
    return int(table["loads"].sum()), int(table["tasks"].sum())


def run_size(client: Client, texts: list[str], size: int, workers: int) -> dict:
    """Score ``texts`` in tasks of ``size`` on ``client``'s cluster; return the row."""
    work = h.batches(texts, size)
    loads_before, served_before = _loads(client)
    cpu_before = client.run(time.process_time)
    with get_task_stream(client) as stream, h.Timer() as wall:
        futures = dask_pcm.map(client, h.score_batch, work, context=h.CONTEXT, pure=False)
        predictions = client.gather(futures)
    cpu_after = client.run(time.process_time)
    loads_after, served_after = _loads(client)
    if served_after - served_before != len(work):
        raise RuntimeError(
            f"batch {size}: {served_after - served_before} tasks served, not {len(work)}"
        )
    seconds = np.array(
        [
            sum(s["stop"] - s["start"] for s in task["startstops"] if s["action"] == "compute")
            for task in stream.data
        ]
    )
    if len(seconds) != len(work):
        raise RuntimeError(
            f"batch {size}: {len(seconds)} tasks in the task stream, not {len(work)}"
        )
    cpu = sum(cpu_after[w] - cpu_before[w] for w in cpu_before)
    return {
        "batch_size": size,
        "tasks": len(work),
        "loads": loads_after - loads_before,
        "wall_seconds": wall.seconds,
        "claims_per_second": len(texts) / wall.seconds,
        "task_min_seconds": float(seconds.min()),
        "task_median_seconds": float(np.median(seconds)),
        "task_p90_seconds": float(np.percentile(seconds, 90)),
        "task_max_seconds": float(seconds.max()),
        "task_seconds_sum": float(seconds.sum()),
        "cpu_share": cpu / (workers * wall.seconds),
        "load_average": os.getloadavg()[0],
        "predictions": [p for batch in predictions for p in batch],
    }


def run_level(level: str, model: str, texts: list[str], sizes: list[int], workers: int) -> list:
    """Every batch size at ``level`` on one fresh cluster; the rows, in order of ``sizes``."""
    rows = []
    with (
        h.warm_cluster(model, workers) as client,
    ):
        dask_pcm.register(client, dask_pcm.causal_lm(model, name=h.CONTEXT), level=level)
        warm = h.batches(texts[: 8 * workers], 8)
        client.gather(dask_pcm.map(client, h.score_batch, warm, context=h.CONTEXT, pure=False))
        for size in sizes:
            rows.append({"level": level, **run_size(client, texts, size, workers)})
            r = rows[-1]
            print(
                f"  {level}, batch {size}: {r['wall_seconds']:.1f} s wall, "
                f"cpu share {r['cpu_share']:.2f}, load average {r['load_average']:.2f}",
                flush=True,
            )
    if level == "full" and any(r["loads"] for r in rows):
        raise RuntimeError(f"the resident model was loaded again: {[r['loads'] for r in rows]}")
    return rows


def main() -> None:
    p = h.parser(__doc__.split("\n\n")[0])
    p.add_argument("--claims", type=int, help="claims to score (default 128, --quick 16)")
    p.add_argument(
        "--sizes", help="comma-separated claims per task (default 1,2,4,8,16,32,64; --quick 1,4,16)"
    )
    p.add_argument(
        "--levels", default="partial,full", help="comma-separated levels (default partial,full)"
    )
    args = p.parse_args()
    n = args.claims or (16 if args.quick else 128)
    sizes = [
        int(s) for s in (args.sizes or ("1,4,16" if args.quick else "1,2,4,8,16,32,64")).split(",")
    ]
    levels = [config.check_level(level.strip()) for level in args.levels.split(",")]

    model = h.model_path(args)
    claims = h.load_claims(args.data, n)
    texts = [c.claim for c in claims]
    print(
        f"{n} claims, batch sizes {sizes}, levels {levels}, {args.workers} workers x 1 thread, "
        f"model {model}; load average {os.getloadavg()[0]:.2f}"
    )
    rows = [row for level in levels for row in run_level(level, model, texts, sizes, args.workers)]

    # Same batches, same model: the levels must agree claim for claim.
    by_size: dict[int, list[int]] = {}
    for row in rows:
        expected = by_size.setdefault(row["batch_size"], row["predictions"])
        wrong = sum(a != b for a, b in zip(row["predictions"], expected, strict=True))
        if wrong:
            raise AssertionError(
                f"batch {row['batch_size']}: {wrong} of {n} predictions differ between levels"
            )
    for row in rows:
        row["accuracy"] = h.accuracy(row.pop("predictions"), claims)
    print()
    h.print_table(rows, COLUMNS)
    print()
    for level in levels:
        rate = {r["batch_size"]: r["claims_per_second"] for r in rows if r["level"] == level}
        best = max(rate, key=rate.__getitem__)
        print(
            f"{level}: best {rate[best]:.2f} claims/s at batch {best}; "
            + ", ".join(f"{s}: {v / rate[best]:.2f}" for s, v in rate.items())
            + " of best"
        )
    accuracies = sorted({round(r["accuracy"], 4) for r in rows})
    print(f"identical predictions at both levels; accuracy by batch size {accuracies}")
    h.write_json(args.json, rows)
    h.plot_bars(
        args.json,
        rows,
        "batch_size",
        "claims_per_second",
        group="level",
        title=f"{n} FEVER claims, {args.workers} workers",
        ylabel="claims/s (higher is better)",
    )


if __name__ == "__main__":
    main()
