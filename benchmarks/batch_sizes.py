"""Batch sizes (RQ2): claims per task from 1 to 64 at context levels partial and full.

The same N FEVER claims (default 256, ``--quick`` 16), the same prompt and scoring task as
``levels.py`` (``_harness.score_batch``: one-token answers True/False/Unknown, the embedded
SmolLM2-135M-Instruct by default), cut into tasks of 1, 4, 16 and 64 claims (``--sizes``, e.g.
``1,2,4,8,16,32,64``; ``--quick``: 1, 16). One ``dask_pcm.local_cluster`` (2 workers x 1
thread by default) holds the model as two contexts, one per level (``llm-partial``,
``llm-full``), so that every (level, size) run shares the same workers and the runs can be
interleaved: the protocol's rounds (``_protocol``, ``--repetitions``, default 3), each running
every (level, size) once in a seeded random order, plus the **ideal at each size**: bare
processes (``_harness.ideal``) scoring the same tasks from a shared queue, so that a size's
cost can be told from dask_pcm's cost at that size. At ``full`` the model stays resident
through all runs (the benchmark stops if it was loaded again); at ``partial`` every task builds
it from the worker-local template copy, so small batches pay one build for few claims.

N defaults to 256 so that the largest batch is still 4 tasks (2 per worker) rather than one
task whose worker finishes alone.

Outside all timings: a first model load in each worker before ``register`` (then released:
imports, as in ``levels.py``), ``register`` itself, and one untimed round of one task of 8
claims per worker and context (a worker's first forward passes are slower than later ones).

Per run (JSON ``rows``):

- ``wall_s``: from submitting the tasks of that size to having every result; ``claims/s`` is
  N / ``wall_s``; for the ideal, from all loaded to all scored.
- task seconds (min, median, p90, max): from Dask's task stream (``distributed.get_task_stream``),
  the ``compute`` interval of each task on its worker. It covers the whole task, so at
  ``partial`` it includes building the model from the local copy and releasing it; p90 is
  numpy's linear interpolation.
- ``loads``: model loads during the run, from ``dask_pcm.status`` (one per task at partial,
  none at full).
- ``cpu``: CPU seconds of the worker processes during ``wall_s`` over workers x ``wall_s``.

Summary (JSON ``summary``), per level and size, each the median and 95 % interval over the
rounds: claims/s; **efficiency**, ideal wall / level wall at that size, paired by round (the
spread of efficiencies across sizes is the batch size's effect on dask_pcm, with the model's
own cost of a size divided out); and the share of the level's best claims/s.

The batch size is claims per task, the paper's sense. The forward pass itself is capped by
``LanguageModel.batch_size`` (8 prompts on a CPU worker): a task of 64 claims runs 8 passes.
Every run must give the same predictions as the first at its size, or the benchmark stops.

Examples::

    python benchmarks/batch_sizes.py --quick
    python benchmarks/batch_sizes.py --json /tmp/batch-sizes.json
    python benchmarks/batch_sizes.py --claims 512 --sizes 8,64 --levels full
"""

from __future__ import annotations

import functools
import os
import statistics
import time

import _harness as h
import _protocol as P
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


TASK_KEYS = ("task_min_seconds", "task_median_seconds", "task_p90_seconds", "task_max_seconds")


def _loads(client: Client, context: str) -> tuple[int, int]:
    table = dask_pcm.status(client, [context])
    return int(table["loads"].sum()), int(table["tasks"].sum())


def _context(level: str) -> str:
    return f"{h.CONTEXT}-{level}"


def run_size(client: Client, texts: list[str], size: int, workers: int, context: str) -> dict:
    """Score ``texts`` in tasks of ``size`` with ``context``; return the row."""
    work = h.batches(texts, size)
    loads_before, served_before = _loads(client, context)
    cpu_before = client.run(time.process_time)
    task = functools.partial(h.score_batch, context=context)
    with get_task_stream(client) as stream, h.Timer() as wall:
        futures = dask_pcm.map(client, task, work, context=context, pure=False)
        predictions = client.gather(futures)
    cpu_after = client.run(time.process_time)
    loads_after, served_after = _loads(client, context)
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
        "task_min_seconds": float(seconds.min()),
        "task_median_seconds": float(np.median(seconds)),
        "task_p90_seconds": float(np.percentile(seconds, 90)),
        "task_max_seconds": float(seconds.max()),
        "task_seconds_sum": float(seconds.sum()),
        "cpu_share": cpu / (workers * wall.seconds),
        "load_average": os.getloadavg()[0],
        "predictions": [p for batch in predictions for p in batch],
    }


def run_ideal(model: str, texts: list[str], size: int, workers: int) -> dict:
    base = h.ideal(model, h.batches(texts, size), workers)
    return {
        "batch_size": size,
        "tasks": len(h.batches(texts, size)),
        "loads": 0,  # its loads are before its window
        "wall_seconds": base["wall_seconds"],
        **{key: float("nan") for key in TASK_KEYS},  # no task stream
        "cpu_share": base["cpu_seconds"] / (workers * base["wall_seconds"]),
        "load_average": os.getloadavg()[0],
        "predictions": [p for batch in base["predictions"] for p in batch],
    }


def summarise(rows: list[dict], levels: list[str], sizes: list[int]) -> list[dict]:
    """Per level and size: claims/s, efficiency (ideal wall / wall, paired by round) and the
    share of the level's best claims/s, each a median and 95 % interval over rounds."""
    out = []
    rate = {
        (level, size): [r["claims_per_second"] for r in sorted(rows, key=lambda r: r["round"])
                        if r["level"] == level and r["batch_size"] == size]
        for level in ("ideal", *levels) for size in sizes
    }  # fmt: skip
    for level in ("ideal", *levels):
        best = max(sizes, key=lambda s: statistics.median(rate[(level, s)]))
        for size in sizes:
            row = {"level": level, "batch_size": size}
            out.append({**row, "metric": "claims_per_second", **P.interval(rate[(level, size)])})
            if level != "ideal":
                # ideal wall / level wall = level claims/s / ideal claims/s
                eff = P.ratio_interval(rate[(level, size)], rate[("ideal", size)])
                out.append(
                    {
                        **row,
                        "metric": "efficiency",
                        **eff,
                        "measurement_error": eff["runs"] > 1 and eff["low"] > 1,
                    }
                )
            share = P.ratio_interval(rate[(level, size)], rate[(level, best)])
            out.append({**row, "metric": "share_of_best", "best_size": best, **share})
    return out


def main() -> None:
    p = h.parser(__doc__.split("\n\n")[0])
    p.add_argument("--claims", type=int, help="claims to score (default 256, --quick 16)")
    p.add_argument(
        "--sizes", help="comma-separated claims per task (default 1,4,16,64; --quick 1,16)"
    )
    p.add_argument(
        "--levels", default="partial,full", help="comma-separated levels (default partial,full)"
    )
    args = p.parse_args()
    reps = P.repetitions(args.quick, args.repetitions)
    n = args.claims or (16 if args.quick else 256)
    sizes = [int(s) for s in (args.sizes or ("1,16" if args.quick else "1,4,16,64")).split(",")]
    levels = [config.check_level(level.strip()) for level in args.levels.split(",")]

    model = h.model_path(args)
    claims = h.load_claims(args.data, n)
    texts = [c.claim for c in claims]
    variants = [f"{level}@{size}" for level in ("ideal", *levels) for size in sizes]
    order = P.schedule(variants, reps, args.seed)
    print(
        f"{n} claims, batch sizes {sizes}, levels {levels} and the ideal, {args.workers} workers "
        f"x 1 thread, {len(order)} runs in {reps} rounds (seed {args.seed}), model {model}; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    rows: list[dict] = []
    expected: dict[int, list[int]] = {}
    with h.warm_cluster(model, args.workers) as client:
        for level in levels:
            ctx = dask_pcm.causal_lm(model, name=_context(level), level=level)
            dask_pcm.register(client, ctx)
            warm = h.batches(texts[: 8 * args.workers], 8)
            task = functools.partial(h.score_batch, context=_context(level))
            client.gather(dask_pcm.map(client, task, warm, context=_context(level), pure=False))
        for rnd, variant in order:
            level, _, size_text = variant.partition("@")
            size = int(size_text)
            if level == "ideal":
                row = run_ideal(model, texts, size, args.workers)
            else:
                row = run_size(client, texts, size, args.workers, _context(level))
            row = {"round": rnd, "level": level, **row}
            row["claims_per_second"] = n / row["wall_seconds"]
            # Same batches, same model: every run must agree claim for claim.
            got = row.pop("predictions")
            wrong = sum(a != b for a, b in zip(got, expected.setdefault(size, got), strict=True))
            if wrong:
                raise AssertionError(f"{variant}, round {rnd}: {wrong} of {n} predictions differ")
            rows.append(row)
            print(
                f"  round {rnd} {level}, batch {size}: {row['wall_seconds']:.1f} s wall, "
                f"cpu share {row['cpu_share']:.2f}, load average {row['load_average']:.2f}",
                flush=True,
            )
        if "full" in levels:
            reloaded = sum(r["loads"] for r in rows if r["level"] == "full")
            if reloaded:
                raise RuntimeError(f"the resident model was loaded again {reloaded} times")
    rows.sort(key=lambda r: (r["round"], r["level"], r["batch_size"]))
    print()
    h.print_table(rows, [("round", "round", "d"), *COLUMNS])
    summary = summarise(rows, levels, sizes)
    print()
    for s in summary:
        if s["metric"] != "claims_per_second" and s["level"] != "ideal":
            extra = "  MEASUREMENT ERROR: above the ideal" if s.get("measurement_error") else ""
            print(
                f"  {s['level']:<8} batch {s['batch_size']:>3}  {s['metric']:<14} "
                f"{P.format_interval(s)}{extra}"
            )
    accuracy = h.accuracy(expected[sizes[0]], claims)
    print(f"identical predictions in every run; accuracy {accuracy:.3f} on {n} claims")
    h.write_json(
        args.json,
        rows,
        reps=reps,
        summary=summary,
        seed=args.seed,
        claims=n,
        workers=args.workers,
        accuracy=accuracy,
    )
    h.plot_bars(
        args.json,
        [s for s in summary if s["metric"] == "claims_per_second"],
        "batch_size",
        "median",
        group="level",
        title=f"{n} FEVER claims, {args.workers} workers (median of {reps})",
        ylabel="claims/s (higher is better)",
    )


if __name__ == "__main__":
    main()
