"""Throughput of no-op context tasks against the same plain Dask tasks, in one run.

What dask_pcm adds per task: the scheduler plugin's placement (a shared worker-restriction
set, set in ``update_graph``) and per-task counting (its ``transition`` hook, which runs for
every task), and on the worker a ``ContextTask`` that looks the context up and counts the
task. The tasks do nothing else, so this is the worst case: any real inference task costs
milliseconds to seconds, against the microseconds measured here.

The same cluster runs five kinds in the protocol's rounds (``_protocol``: ``--repetitions``,
default 3, ``--quick`` 1; each round every kind once, in a seeded random order), each
submitting all tasks with ``client.map`` and gathering them:

- ``plain``: Dask's defaults, which *queue* root tasks on the scheduler and release them as
  worker threads free up;
- ``context``: every worker has the context ready, so the scheduler plugin leaves the tasks
  unrestricted and Dask queues them the same way;
- ``context-restricted``: a second context that one worker is still loading (its loader
  waits until the benchmark ends) while the others hold it: the scheduler plugin restricts
  the tasks to the ready workers, the path a cluster takes while a worker joins or reloads;
- ``plain-restricted``: the same plain tasks restricted by hand (``workers=``) to the same
  ready workers, the baseline for the restricted path;
- ``plain-unqueued``, for reference: queuing off (``worker-saturation: inf``, switched at
  run time).

Throughput is tasks per second of wall time from submission to the last result. Ratios,
per round and then summarised by their median and 95 % interval: context / plain (goal: at
least 0.9) and context-restricted / plain-restricted.

Examples::

    python benchmarks/scheduler_overhead.py --quick
    python benchmarks/scheduler_overhead.py --tasks 20000 --repetitions 5 --json overhead.json
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path

import _harness as h
import _protocol as P
import dask
from distributed import Client

import dask_pcm

CONTEXT = "noop"
COLUMNS = [
    ("kind", "kind", "s"),
    ("round", "round", "d"),
    ("tasks", "tasks", "d"),
    ("wall_seconds", "wall_s", ".2f"),
    ("tasks_per_second", "tasks/s", ".0f"),
]


def noop_loader(location: str) -> dict[str, str]:
    return {"location": location}


def plain(i: int) -> int:
    return i


class with_context:  # lower case: it stands where the plain function `plain` stands
    """The no-op task of context ``name``: looks the context up, returns its argument."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, i: int) -> int:
        dask_pcm.get_context(self.name)
        return i


def _set_saturation(value: float, dask_scheduler: object = None) -> float:
    previous = dask_scheduler.WORKER_SATURATION  # type: ignore[attr-defined]
    dask_scheduler.WORKER_SATURATION = value  # type: ignore[attr-defined]
    return float(previous)


class HeldOnOne:
    """A no-op loader that returns at once, except in the worker process ``pid``, where it
    waits until the file ``release`` exists: that worker stays ``loading``."""

    def __init__(self, pid: int, release_file: str) -> None:
        self.pid, self.release_file = pid, release_file

    def __call__(self, location: str) -> dict[str, str]:
        while os.getpid() == self.pid and not Path(self.release_file).exists():
            time.sleep(0.05)
        return {"location": location}


KINDS = ("plain", "context", "context-restricted", "plain-restricted", "plain-unqueued")
RESTRICTED = "held"


def _hold_one(client: Client, release: Path) -> tuple[threading.Thread, list[str]]:
    """Register :data:`RESTRICTED` in the background with one worker held loading; return the
    registering thread and the addresses of the workers where it is ready."""
    pids = client.run(os.getpid)
    held = sorted(pids)[-1]
    ctx = dask_pcm.Context(RESTRICTED, HeldOnOne(pids[held], str(release)), template="none")
    thread = threading.Thread(target=dask_pcm.register, args=(client, ctx), daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        table = dask_pcm.status(client, [RESTRICTED])
        states = dict(zip(table["worker"], table["state"], strict=True))
        ready = sorted(w for w, state in states.items() if state == "ready")
        if len(ready) == len(pids) - 1 and states.get(held) not in (None, "ready"):
            return thread, ready
        time.sleep(0.1)
    raise RuntimeError(f"context {RESTRICTED!r} never reached one worker loading: {states}")


def _round(client: Client, kind: str, r: int, n: int, ready: list[str]) -> dict:
    keys = [f"{kind}-{r}-{i}" for i in range(n)]
    if kind == "plain-unqueued":
        saturation = client.run_on_scheduler(_set_saturation, float("inf"))
    with h.Timer() as wall:
        if kind in ("plain", "plain-unqueued"):
            futures = client.map(plain, range(n), key=keys)
        elif kind == "plain-restricted":
            futures = client.map(plain, range(n), key=keys, workers=ready)
        else:
            name = RESTRICTED if kind == "context-restricted" else CONTEXT
            futures = dask_pcm.map(client, with_context(name), range(n), context=name, key=keys)
        results = client.gather(futures)
    if kind == "plain-unqueued":
        client.run_on_scheduler(_set_saturation, saturation)
    if results != list(range(n)):
        raise AssertionError(f"{kind} round {r}: wrong results")
    return {
        "kind": kind,
        "round": r,
        "tasks": n,
        "wall_seconds": wall.seconds,
        "tasks_per_second": n / wall.seconds,
    }


def main() -> None:
    p = h.parser(__doc__.split("\n\n")[0])
    p.add_argument("--tasks", type=int, help="tasks per round (default 10000, --quick 2000)")
    args = p.parse_args()
    n = args.tasks or (2000 if args.quick else 10000)
    reps = P.repetitions(args.quick, args.repetitions)
    order = P.schedule(KINDS, reps, args.seed)
    rows = []
    with (
        # Every worker loads at once: the held load must not keep the others from theirs.
        dask.config.set({"pcm.worker.load-concurrency": max(2, args.workers)}),
        tempfile.TemporaryDirectory(prefix="overhead-") as scratch,
        dask_pcm.local_cluster(n_workers=args.workers, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        release = Path(scratch) / "release"
        dask_pcm.register(client, dask_pcm.Context(CONTEXT, noop_loader, template="none"))
        thread, ready = _hold_one(client, release)
        try:
            # Untimed warm-up of every path (imports, function caches, first connections).
            for kind in KINDS:
                _round(client, kind, -1, 100, ready)
            for r, kind in order:
                rows.append(_round(client, kind, r, n, ready))
                print(f"  round {r} {kind}: {rows[-1]['tasks_per_second']:.0f} tasks/s", flush=True)
            table = dask_pcm.status(client, [CONTEXT, RESTRICTED])
        finally:
            release.touch()
            thread.join(timeout=30)
    served = {c: int(table[table["context"] == c]["tasks"].sum()) for c in (CONTEXT, RESTRICTED)}
    rows.sort(key=lambda r: (r["round"], KINDS.index(r["kind"])))
    h.print_table(rows, COLUMNS)
    rate = P.by_variant(rows, "kind", "tasks_per_second")
    summary = [{"metric": "tasks_per_second", "kind": k, **P.interval(rate[k])} for k in KINDS]
    for num, den in (("context", "plain"), ("context-restricted", "plain-restricted")):
        ratio = P.ratio_interval(rate[num], rate[den])
        summary.append({"metric": f"{num}_over_{den}", **ratio, "clears_noise": P.clears(ratio)})
    print()
    for s in summary:
        what = s.get("kind") or s["metric"].replace("_over_", " / ")
        print(f"  {what:<38} {P.format_interval(s, '.3g')}")
    print(f"context tasks counted by the scheduler plugin: {served} (goal context / plain >= 0.9)")
    h.write_json(
        args.json,
        rows,
        reps=reps,
        summary=summary,
        seed=args.seed,
        served=served,
        workers=args.workers,
        restricted_to=len(ready),
    )
    plot(args.json, rows)


def plot(path: Path | None, rows: list[dict]) -> None:
    """Tasks per second per kind and round (the PNG beside ``path``)."""
    h.plot_bars(
        path,
        rows,
        "kind",
        "tasks_per_second",
        group="round",
        title=f"{rows[0]['tasks']} no-op tasks per round",
        ylabel="tasks/s (higher is better)",
    )


if __name__ == "__main__":
    main()
