"""Throughput of no-op context tasks against the same plain Dask tasks, in one run.

What dask_pcm adds per task: the scheduler plugin's placement (a shared worker-restriction
set, set in ``update_graph``) and per-task counting (its ``transition`` hook, which runs for
every task), and on the worker a ``ContextTask`` that looks the context up and counts the
task. The tasks do nothing else, so this is the worst case: any real inference task costs
milliseconds to seconds, against the microseconds measured here.

The same cluster runs three kinds alternately, ``--rounds`` times each, each round
submitting all tasks with ``client.map`` and gathering them: ``plain`` (Dask's defaults,
which *queue* root tasks on the scheduler and release them as worker threads free up),
``context`` (every worker has the context ready, so the scheduler plugin leaves the tasks
unrestricted and Dask queues them the same way) and, for reference, ``plain-unqueued``
(queuing off, ``worker-saturation: inf``, switched at run time; the path restricted tasks
take). Throughput is tasks per second of wall time from submission to the last result; the
ratio is the best context round over the best plain round (goal: at least 0.9).

Examples::

    python benchmarks/scheduler_overhead.py --quick
    python benchmarks/scheduler_overhead.py --tasks 20000 --json overhead.json
"""

from __future__ import annotations

from pathlib import Path

import _harness as h
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


def with_context(i: int) -> int:
    dask_pcm.get_context(CONTEXT)
    return i


def _set_saturation(value: float, dask_scheduler: object = None) -> float:
    previous = dask_scheduler.WORKER_SATURATION  # type: ignore[attr-defined]
    dask_scheduler.WORKER_SATURATION = value  # type: ignore[attr-defined]
    return float(previous)


KINDS = ("plain", "context", "plain-unqueued")


def main() -> None:
    p = h.parser(__doc__.split("\n\n")[0])
    p.add_argument("--tasks", type=int, help="tasks per round (default 20000, --quick 2000)")
    p.add_argument("--rounds", type=int, help="rounds of each kind (default 2, --quick 1)")
    args = p.parse_args()
    n = args.tasks or (2000 if args.quick else 20000)
    rounds = args.rounds or (1 if args.quick else 2)
    rows = []
    with (
        dask_pcm.local_cluster(n_workers=args.workers, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        dask_pcm.register(client, dask_pcm.Context(CONTEXT, noop_loader, template="none"))
        # Untimed warm-up of both paths (imports, function caches, first connections).
        client.gather(client.map(plain, range(100), key=[f"warm-plain-{i}" for i in range(100)]))
        client.gather(dask_pcm.map(client, with_context, range(100), context=CONTEXT))
        for r in range(rounds):
            for kind in KINDS:
                keys = [f"{kind}-{r}-{i}" for i in range(n)]
                if kind == "plain-unqueued":
                    saturation = client.run_on_scheduler(_set_saturation, float("inf"))
                with h.Timer() as wall:
                    if kind.startswith("plain"):
                        futures = client.map(plain, range(n), key=keys)
                    else:
                        futures = dask_pcm.map(
                            client, with_context, range(n), context=CONTEXT, key=keys
                        )
                    results = client.gather(futures)
                assert results == list(range(n)), f"{kind} round {r}: wrong results"
                del futures
                if kind == "plain-unqueued":
                    client.run_on_scheduler(_set_saturation, saturation)
                rows.append(
                    {
                        "kind": kind,
                        "round": r,
                        "tasks": n,
                        "wall_seconds": wall.seconds,
                        "tasks_per_second": n / wall.seconds,
                    }
                )
        served = int(dask_pcm.status(client, [CONTEXT])["tasks"].sum())
    h.print_table(rows, COLUMNS)
    best = {k: max(r["tasks_per_second"] for r in rows if r["kind"] == k) for k in KINDS}
    ratio = best["context"] / best["plain"]
    print(
        f"\nbest tasks/s: plain {best['plain']:.0f}, context {best['context']:.0f}, "
        f"plain-unqueued {best['plain-unqueued']:.0f}\n"
        f"context / plain: {ratio:.3f} (goal >= 0.9); context / plain-unqueued: "
        f"{best['context'] / best['plain-unqueued']:.3f}\n"
        f"context tasks counted by the scheduler plugin: {served}"
    )
    h.write_json(
        args.json,
        [
            *rows,
            {
                "kind": "ratio",
                "context_over_plain": ratio,
                "context_over_plain_unqueued": best["context"] / best["plain-unqueued"],
                "served": served,
            },
        ],
    )
    plot(args.json, rows)


def plot(path: Path | None, rows: list[dict]) -> None:
    """Tasks per second per kind and round (the PNG beside ``path``)."""
    h.plot_bars(
        path,
        [r for r in rows if r["kind"] in KINDS],
        "kind",
        "tasks_per_second",
        group="round",
        title=f"{rows[0]['tasks']} no-op tasks per round",
        ylabel="tasks/s (higher is better)",
    )


if __name__ == "__main__":
    main()
