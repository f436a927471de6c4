"""Peers: dask_pcm against Ray Data and plain Dask, on the same FEVER scoring work.

Scores N claims (512; ``--quick`` 32) in batches of 8, one forward pass of a causal LM per
batch (default: the embedded SmolLM2-135M-Instruct), with the same number of workers (2 x 1
thread by default), six ways, each on processes of its own, in the protocol's rounds
(``_protocol``: ``--repetitions``, default 3, ``--quick`` 1; every variant once per round, in a
seeded random order):

- ``ideal``: ``_harness.ideal``: one bare process per worker (multiprocessing, spawn) loads the
  model once; the processes take the batches from one shared queue.
- ``dask_pcm``: the context at level ``full`` on a ``dask_pcm.local_cluster``, as in
  ``levels.py``: ``dask_pcm.register`` loads the model once on every worker and
  ``dask_pcm.map`` sends ``_harness.score_batch`` to workers where it is ready.
- ``dask_pcm-prefix``: the same with prompt-prefix reuse, as ``run_fever`` scores by default:
  the template's part before the claim runs once per worker and its key/value states are
  kept (``pcm.worker.prefix-cache``); the predictions must not change.
- ``dask-per-task``: plain Dask written by hand, the first program a user writes: a
  ``distributed.LocalCluster`` (processes) and ``client.map`` of a function that builds the
  model with ``dask_pcm.CausalLM(device="cpu")`` and scores its batch: every task loads.
- ``dask-global``: the usual hand-written fix: the same function keeps the model in a
  module-level dictionary of the worker process; the first task on a worker loads it, the
  later ones reuse it.
- ``ray-data``: ``ray.data.from_pandas`` (one block per batch), then ``map_batches`` of a
  callable class that loads the model in ``__init__`` and scores a batch in ``__call__``, with
  ``batch_size=8`` on a fixed pool of one actor per worker (``ActorPoolStrategy(size=workers)``,
  one CPU each, ``ray.init(num_cpus=workers)``). When ray cannot be imported the row is
  skipped and the reason printed (``pip install -e '.[bench]'``); with
  ``PCM_BENCH_REQUIRE_RAY=1`` (set by CI) the run fails instead.

Two windows per run. **End to end** (``end_to_end_s``): from the variant's first step (starting
its cluster, ``ray.init`` or its processes) to having every result: start-up, imports,
warm-up, ``register`` and every load inside, for every variant alike. **Steady**
(``seconds``): from submitting the work to having every result in the client; for the ideal,
from all its processes loaded to all done. In the steady window, everything a variant does
after the submission is inside; what a user of that framework can do before submitting is not:

- Outside, for every variant: starting the cluster (worker processes; for Ray, ``ray.init``
  with its own processes) and the imports. Every Dask worker loads the model once and drops it
  before the window, as ``levels.py`` does: the first load in a process imports torch,
  transformers and their lazily imported model code (about 3 s here). Under Ray the same
  load-and-drop runs as one task per CPU, and a trivial Ray Data pipeline warms the driver's
  side (Ray Data's own imports and executor), also before the window.
- Outside, and reported as ``setup_s``: ``dask_pcm.register`` (the model loads) and the
  ideal's process start, imports and loads. Both load ahead of the work by design.
- Inside: every load of ``dask-per-task``; the load in the first task on each worker of
  ``dask-global``; for ``ray-data``, the actor pool's start: Ray Data creates its actors when
  the dataset executes, and each loads the model in ``__init__``. Ray Data has no call that
  starts the pool before the work is submitted. Had Ray placed an actor in a worker process
  that ran the warm-up, its imports would be outside the window; ``warm_actors`` counts such
  actors. With ray 2.60 here there were none: every actor ran in another process, so its
  imports are inside the window, in its load (and its process start, unless Ray had started
  that process ahead).

``loads`` counts the model loads that served the work (not the warm-up's load-and-drop),
``timed_loads`` those inside the window, ``load_s`` the seconds of those loads summed over
workers (``dask_pcm.status`` for dask_pcm; measured around the load for the others; the
ideal's and Ray's loads are the first in their process and include the imports). Loads and
tasks per worker are in the JSON (per worker process id for the hand-written variants), and so
is ``total_seconds``: the variant from start to end, cluster start-up, warm-up and shutdown
included. ``cpu``: CPU seconds of the worker processes during the window over workers x
``seconds`` (for Ray, of the actor processes from the start of ``__init__``): about 1.0 when
each worker had its core. Summary, per window and variant, each a median and 95 % interval of
per-round ratios: claims/s over dask_pcm's (``vs_dask_pcm``), and in the steady window the
efficiency, ideal seconds / seconds; an efficiency above 1 beyond its interval is flagged as
an error of measurement (the ideal is a lower bound). Every run must predict exactly what
the first run predicted; the benchmark stops otherwise.

Made equal, so that the rows differ in how the model is handled and in nothing else: every
worker runs one OpenMP/MKL thread (torch's thread count is checked on every worker) and no
``MALLOC_TRIM_THRESHOLD_`` (``_harness._worker_environ``). The plain Dask clusters get
``distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_: null`` and the 100 ms profiler
interval, the settings ``dask_pcm/deploy/local.py`` tells users who start their own workers to use
(it reports tasks about 30 % slower with distributed's heap trimming; not measured here).

Plain Dask and a script: the hand-written functions are submitted as attributes of module
``peers`` (this file, imported by the workers), not of ``__main__``. Dask pickles a function of
``__main__`` by value, each task with its own copy of the globals it reads, so a module-level
cache written in the script itself is never hit and every task loads (seen with distributed
2026.8). In a module, as here, the cache works.

The machine is shared with other work and has 2 vCPUs: quote the intervals, not single rows.

Examples::

    python benchmarks/peers.py --quick
    python benchmarks/peers.py --json /tmp/peers.json
"""

from __future__ import annotations

import functools
import importlib
import json
import logging
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import _harness as h
import _protocol as P
import dask
from distributed import Client, LocalCluster

import dask_pcm

VARIANTS = ("ideal", "dask_pcm", "dask_pcm-prefix", "dask-per-task", "dask-global", "ray-data")
COLUMNS = [
    ("round", "round", "d"),
    ("variant", "variant", ""),
    ("tasks", "tasks", "d"),
    ("loads", "loads", "d"),
    ("timed_loads", "timed", "d"),
    ("load_seconds", "load_s", ".2f"),
    ("setup_seconds", "setup_s", ".2f"),
    ("seconds", "seconds", ".2f"),
    ("claims_per_s", "claims/s", ".2f"),
    ("end_to_end_seconds", "end_to_end_s", ".2f"),
    ("cpu_share", "cpu", ".2f"),
]
# What dask_pcm's own workers run with (dask_pcm/deploy/local.py), given to the plain Dask clusters.
PLAIN_DASK_CONFIG = {
    "distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None,
    "distributed.worker.profile.interval": "100ms",
}


# -- on the workers ---------------------------------------------------------------------------
def _settings() -> tuple[int, str | None]:
    """torch's thread count and ``MALLOC_TRIM_THRESHOLD_`` in this process."""
    import torch

    return int(torch.get_num_threads()), os.environ.get("MALLOC_TRIM_THRESHOLD_")


def score_per_task(claims: list[str], model: str) -> tuple[list[int], int, float]:
    """dask-per-task: build the model, score ``claims``, drop the model.

    Returns the predictions, the process id and the seconds the load took.
    """
    start = time.perf_counter()
    loader = dask_pcm.CausalLM(device="cpu")
    lm = loader(model)
    load_seconds = time.perf_counter() - start
    predictions = h.score(lm, claims)
    # Dropped now rather than by the garbage collector, so that copies do not pile up in
    # memory (dask_pcm's agnostic level does the same).
    loader.release(lm)
    return predictions, os.getpid(), load_seconds


_MODELS: dict[str, Any] = {}  # dask-global's cache: model location -> LanguageModel


def score_cached(claims: list[str], model: str) -> tuple[list[int], int, float | None]:
    """dask-global: score ``claims`` with the process's cached model, loading it if absent.

    Returns the predictions, the process id and the seconds of the load (``None`` if none).
    """
    load_seconds = None
    lm = _MODELS.get(model)
    if lm is None:
        start = time.perf_counter()
        lm = _MODELS[model] = dask_pcm.CausalLM(device="cpu")(model)
        load_seconds = time.perf_counter() - start
    return h.score(lm, claims), os.getpid(), load_seconds


class RayScorer:
    """ray-data: Ray Data's pattern for a model, loaded in ``__init__``, used in ``__call__``.

    Once loaded, the actor writes what it measured about itself to ``<report_dir>/<pid>.json``
    (so that an actor that never gets a batch is counted too). A batch must be exactly one of
    the benchmark's batches (the dataset has one block per batch); its rows come back with the
    predictions, the process id and the CPU seconds used since ``__init__`` began.
    """

    def __init__(self, model: str, report_dir: str) -> None:
        self.cpu_start = time.process_time()
        start = time.perf_counter()
        self.lm = dask_pcm.CausalLM(device="cpu")(model)
        threads, malloc_trim = _settings()
        report = {
            "load_seconds": time.perf_counter() - start,
            "cpu_seconds": time.process_time() - self.cpu_start,
            "threads": threads,
            "malloc_trim": malloc_trim,
        }
        Path(report_dir, f"{os.getpid()}.json").write_text(json.dumps(report))

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        import numpy as np

        ids, sizes = set(batch["batch"].tolist()), set(batch["size"].tolist())
        if len(ids) != 1 or sizes != {len(batch["claim"])}:
            raise RuntimeError(
                f"Ray Data gave the actor a batch that is not one benchmark batch: "
                f"batches {sorted(ids)}, sizes {sorted(sizes)}, {len(batch['claim'])} rows"
            )
        predictions = h.score(self.lm, [str(c) for c in batch["claim"]])
        n = len(predictions)
        return {
            "batch": batch["batch"],
            "position": batch["position"],
            "prediction": np.asarray(predictions),
            "pid": np.full(n, os.getpid()),
            "cpu_seconds": np.full(n, time.process_time() - self.cpu_start),
        }


# -- one variant each ---------------------------------------------------------------------------
def _by_reference(obj: Any) -> Any:
    """``obj`` as an attribute of module ``peers`` rather than ``__main__`` (module docstring)."""
    return getattr(importlib.import_module(Path(__file__).stem), obj.__name__)


def _check_settings(settings: list[tuple[int, str | None]], variant: str) -> None:
    # Part of the comparison: more threads would be another machine, heap trimming another
    # allocator.
    if set(settings) != {(1, None)}:
        raise RuntimeError(
            f"{variant}: (torch threads, MALLOC_TRIM_THRESHOLD_) per worker {settings}, "
            "(1, None) expected"
        )


def run_ideal(model: str, work: list[list[str]], workers: int) -> dict:
    base = h.ideal(model, work, workers)
    return {
        "variant": "ideal",
        "loads": workers,
        "timed_loads": 0,
        "load_seconds": base["load_seconds"],
        "setup_seconds": base["startup_seconds"],
        "seconds": base["wall_seconds"],
        "end_to_end_seconds": base["startup_seconds"] + base["wall_seconds"],
        "cpu_share": base["cpu_seconds"] / (workers * base["wall_seconds"]),
        "loads_per_worker": [1] * workers,
        "tasks_per_worker": base["tasks_per_process"],
        "predictions": base["predictions"],
    }


def run_dask_pcm(model: str, work: list[list[str]], workers: int, prefix: bool = False) -> dict:
    """dask_pcm at level full; with ``prefix``, the template's head kept per worker."""
    start = time.perf_counter()
    task = functools.partial(h.score_batch, prefix=prefix)
    with (
        h.warm_cluster(model, workers) as client,
    ):
        _check_settings(list(client.run(_settings).values()), "dask_pcm")
        with h.Timer() as register:
            dask_pcm.register(
                client, dask_pcm.causal_lm(model, name=h.CONTEXT, device="cpu"), level="full"
            )
        loads_before = int(dask_pcm.status(client, [h.CONTEXT])["loads"].sum())
        cpu_before = client.run(time.process_time)
        with h.Timer() as wall:
            futures = dask_pcm.map(client, task, work, context=h.CONTEXT, pure=False)
            predictions = client.gather(futures)
        end_to_end = time.perf_counter() - start
        cpu_after = client.run(time.process_time)
        table = dask_pcm.status(client, [h.CONTEXT])
    if int(table["tasks"].sum()) != len(work) or set(table["level"]) != {"full"}:
        raise RuntimeError(f"status after the dask_pcm run does not add up:\n{table}")
    return {
        "variant": "dask_pcm-prefix" if prefix else "dask_pcm",
        "loads": int(table["loads"].sum()),
        "timed_loads": int(table["loads"].sum()) - loads_before,
        "load_seconds": float(table["load_seconds"].sum()),
        "setup_seconds": register.seconds,
        "seconds": wall.seconds,
        "end_to_end_seconds": end_to_end,
        "cpu_share": sum(cpu_after[w] - cpu_before[w] for w in cpu_before)
        / (workers * wall.seconds),
        "loads_per_worker": [int(n) for n in table["loads"]],
        "tasks_per_worker": [int(n) for n in table["tasks"]],
        "predictions": predictions,
    }


def run_plain_dask(variant: str, model: str, work: list[list[str]], workers: int) -> dict:
    """``dask-per-task`` or ``dask-global`` on a plain ``distributed.LocalCluster``."""
    fn = _by_reference(score_per_task if variant == "dask-per-task" else score_cached)
    start = time.perf_counter()
    with (
        dask.config.set(PLAIN_DASK_CONFIG),
        LocalCluster(
            n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
    ):
        client.wait_for_workers(workers)
        client.run(h.warm_up, model)
        _check_settings(list(client.run(_settings).values()), variant)
        cpu_before = client.run(time.process_time)
        with h.Timer() as wall:
            futures = client.map(fn, work, model=model, pure=False)
            results = client.gather(futures)
        end_to_end = time.perf_counter() - start
        cpu_after = client.run(time.process_time)
    pids = sorted({pid for _, pid, _ in results})
    loads = Counter(pid for _, pid, load in results if load is not None)
    return {
        "variant": variant,
        "loads": sum(loads.values()),
        "timed_loads": sum(loads.values()),
        "load_seconds": sum(load for _, _, load in results if load is not None),
        "setup_seconds": 0.0,
        "seconds": wall.seconds,
        "end_to_end_seconds": end_to_end,
        "cpu_share": sum(cpu_after[w] - cpu_before[w] for w in cpu_before)
        / (workers * wall.seconds),
        "loads_per_worker": [loads[pid] for pid in pids],
        "tasks_per_worker": [sum(pid == p for _, p, _ in results) for pid in pids],
        "predictions": [predictions for predictions, _, _ in results],
    }


def _ray_warm_up_process(model: str) -> int:
    h.warm_up(model)
    return os.getpid()


def _ray_identity(batch: dict[str, Any]) -> dict[str, Any]:
    return batch


def run_ray_data(model: str, work: list[list[str]], workers: int) -> dict:
    import pandas as pd
    import ray
    import ray.data

    # No usage report to Anyscale (this machine has no internet), and a local instance of our
    # own even if another session runs Ray on this host.
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    start = time.perf_counter()
    ray.init(
        address="local",
        num_cpus=workers,
        num_gpus=0,
        include_dashboard=False,
        object_store_memory=512 * 2**20,
        log_to_driver=False,
        logging_level=logging.WARNING,
    )
    try:
        # A line per execution step otherwise; warnings and errors still show.
        logging.getLogger("ray.data").setLevel(logging.WARNING)
        ray.data.DataContext.get_current().enable_progress_bars = False
        warm_up = ray.remote(num_cpus=1)(_by_reference(_ray_warm_up_process))
        warm_pids = set(ray.get([warm_up.remote(model) for _ in range(workers)]))
        ray.data.range(workers, override_num_blocks=workers).map_batches(_ray_identity).take_all()
        # One block per benchmark batch, so that batch_size=8 hands out exactly our batches.
        ds = ray.data.from_pandas(
            [
                pd.DataFrame(
                    {
                        "batch": i,
                        "position": range(len(claims)),
                        "size": len(claims),
                        "claim": claims,
                    }
                )
                for i, claims in enumerate(work)
            ]
        )
        batch_size = max(len(claims) for claims in work)
        with tempfile.TemporaryDirectory(prefix="peers-ray-") as report_dir:
            with h.Timer() as wall:
                rows = ds.map_batches(
                    _by_reference(RayScorer),
                    fn_constructor_args=(model, report_dir),
                    batch_size=batch_size,
                    batch_format="numpy",
                    compute=ray.data.ActorPoolStrategy(size=workers),
                    num_cpus=1,
                ).take_all()
            end_to_end = time.perf_counter() - start
            actors = {
                int(f.stem): json.loads(f.read_text()) for f in Path(report_dir).glob("*.json")
            }
    finally:
        ray.shutdown()
    predictions: list[list[int | None]] = [[None] * len(claims) for claims in work]
    tasks: Counter[int] = Counter()
    for row in rows:
        predictions[int(row["batch"])][int(row["position"])] = int(row["prediction"])
        pid = int(row["pid"])
        tasks[pid] += int(row["position"]) == 0
        actor = actors[pid]
        actor["cpu_seconds"] = max(actor["cpu_seconds"], float(row["cpu_seconds"]))
    if any(p is None for batch in predictions for p in batch):
        raise RuntimeError("Ray Data returned fewer rows than it was given")
    _check_settings([(a["threads"], a["malloc_trim"]) for a in actors.values()], "ray-data")
    return {
        "variant": "ray-data",
        "loads": len(actors),
        "timed_loads": len(actors),
        "load_seconds": sum(a["load_seconds"] for a in actors.values()),
        "setup_seconds": 0.0,
        "seconds": wall.seconds,
        "end_to_end_seconds": end_to_end,
        "cpu_share": sum(a["cpu_seconds"] for a in actors.values()) / (workers * wall.seconds),
        "loads_per_worker": [1] * len(actors),
        "tasks_per_worker": [tasks[pid] for pid in sorted(actors)],
        "warm_actors": len(actors.keys() & warm_pids),
        "predictions": predictions,
    }


def _ray_missing() -> str | None:
    try:
        import ray.data  # noqa: F401
    except ImportError as exc:
        return f"{exc} (pip install -e '.[bench]')"
    return None


def _flat(per_batch: list[list[int]]) -> list[int]:
    return [i for batch in per_batch for i in batch]


def _run(variant: str, model: str, work: list[list[str]], workers: int) -> dict:
    if variant == "ideal":
        return run_ideal(model, work, workers)
    if variant in ("dask_pcm", "dask_pcm-prefix"):
        return run_dask_pcm(model, work, workers, prefix=variant == "dask_pcm-prefix")
    if variant == "ray-data":
        return run_ray_data(model, work, workers)
    return run_plain_dask(variant, model, work, workers)


# Variants that run less work than the ideal (fewer token positions per claim): the ideal is
# not a lower bound on their time.
SHORTER_WORK = frozenset({"dask_pcm-prefix"})


def summarise(rows: list[dict], variants: list[str]) -> list[dict]:
    """Per variant and window: seconds, claims/s over dask_pcm's (paired by round) and, in
    the steady window, the efficiency (ideal / variant); median and 95 % interval each."""
    out = []
    for window, key in (("steady", "seconds"), ("end_to_end", "end_to_end_seconds")):
        per = P.by_variant(rows, "variant", key)
        for variant in variants:
            row = {"variant": variant, "window": window}
            out.append({**row, "metric": "seconds", **P.interval(per[variant])})
            if "dask_pcm" in per and variant != "dask_pcm":
                # claims/s over dask_pcm's = dask_pcm's seconds over this variant's
                ratio = P.ratio_interval(per["dask_pcm"], per[variant])
                out.append(
                    {**row, "metric": "vs_dask_pcm", **ratio, "clears_noise": P.clears(ratio)}
                )
            if window == "steady" and variant != "ideal":
                eff = P.ratio_interval(per["ideal"], per[variant])
                out.append(
                    {
                        **row,
                        "metric": "efficiency",
                        **eff,
                        # The ideal bounds every variant that runs the same passes from
                        # below: above 1 beyond the interval is an error of measurement.
                        # Prefix reuse runs fewer tokens than the ideal, so it may beat it.
                        "measurement_error": variant not in SHORTER_WORK
                        and eff["runs"] > 1
                        and eff["low"] > 1,
                    }
                )
    return out


def main() -> None:
    p = h.parser(__doc__.split("\n\n")[0])
    p.add_argument("--claims", type=int, help="claims to score (default 512, --quick 32)")
    p.add_argument("--batch-size", type=int, default=8, help="claims per task (default 8)")
    p.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma-separated subset of {', '.join(VARIANTS)} (the ideal always runs)",
    )
    args = p.parse_args()
    reps = P.repetitions(args.quick, args.repetitions)
    n = args.claims or (32 if args.quick else 512)
    chosen = ["ideal"] + [v for v in args.variants.split(",") if v and v != "ideal"]
    unknown = set(chosen) - set(VARIANTS)
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}; choose among {', '.join(VARIANTS)}")
    skipped: dict[str, str] = {}
    if "ray-data" in chosen and (reason := _ray_missing()):
        if os.environ.get("PCM_BENCH_REQUIRE_RAY") == "1":  # CI: absence is a failure
            sys.exit(f"ray-data: ray cannot be imported and PCM_BENCH_REQUIRE_RAY=1: {reason}")
        skipped["ray-data"] = reason
        print(f"  ray-data: skipped, ray cannot be imported: {reason}", flush=True)
        chosen.remove("ray-data")

    model = h.model_path(args)
    claims = h.load_claims(args.data, n)
    work = h.batches([c.claim for c in claims], args.batch_size)
    order = P.schedule(chosen, reps, args.seed)
    print(
        f"{n} claims in {len(work)} tasks of {args.batch_size}, {args.workers} workers x 1 thread, "
        f"{len(order)} runs in {reps} rounds (seed {args.seed}), model {model}; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    rows: list[dict] = []
    expected: list[int] | None = None
    for rnd, variant in order:
        with h._worker_environ(), h.Timer() as total:
            row = _run(variant, model, work, args.workers)
        row.update(round=rnd, tasks=len(work), claims=n, claims_per_s=n / row["seconds"])
        row["total_seconds"] = total.seconds  # start-up, warm-up and shutdown included
        row["load_average"] = os.getloadavg()[0]
        print(
            f"  round {rnd} {variant}: {row['seconds']:.1f} s steady, "
            f"{row['end_to_end_seconds']:.1f} s end to end, {row['timed_loads']} loads in the "
            f"window, cpu share {row['cpu_share']:.2f}, load average {row['load_average']:.2f}",
            flush=True,
        )
        # A benchmark of wrong answers is worthless: every run must predict what the first did.
        got = _flat(row.pop("predictions"))
        expected = expected or got
        wrong = sum(a != b for a, b in zip(got, expected, strict=True))
        if wrong:
            raise AssertionError(f"{variant}, round {rnd}: {wrong} of {n} predictions differ")
        rows.append(row)
    rows.sort(key=lambda r: (r["round"], chosen.index(r["variant"])))
    print()
    h.print_table(rows, COLUMNS)
    summary = summarise(rows, chosen)
    print()
    for s in summary:
        if s["metric"] == "seconds":
            continue
        flag = "  MEASUREMENT ERROR: beats the ideal" if s.get("measurement_error") else ""
        flag = flag or ("  (inside the noise)" if s.get("clears_noise") is False else "")
        print(
            f"  {s['variant']:<16} {s['window']:<10} {s['metric']:<12} {P.format_interval(s)}{flag}"
        )
    ray_rows = [r for r in rows if r["variant"] == "ray-data"]
    if ray_rows:
        warm = sum(r["warm_actors"] for r in ray_rows)
        print(
            f"ray-data: {warm} of {sum(r['loads'] for r in ray_rows)} actors ran in a process "
            "warmed up before the window"
        )
    assert expected is not None
    print(f"identical predictions in every run; accuracy {h.accuracy(expected, claims):.3f}")
    for variant, reason in skipped.items():
        print(f"{variant}: skipped ({reason})")
    h.write_json(
        args.json,
        rows,
        reps=reps,
        summary=summary,
        seed=args.seed,
        claims=n,
        workers=args.workers,
        batch_size=args.batch_size,
        model=model,
        skipped=skipped,
    )
    h.plot_bars(
        args.json,
        [
            {**s, "claims_per_s": n / s["median"]}
            for s in summary
            if s["metric"] == "seconds" and s["window"] == "steady"
        ],
        "variant",
        "claims_per_s",
        title=f"FEVER scoring, {n} claims, {args.workers} workers x 1 thread (median of {reps})",
        ylabel="claims/s",
    )


if __name__ == "__main__":
    main()
