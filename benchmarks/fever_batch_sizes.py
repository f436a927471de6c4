"""Claims per second of ``run_fever`` at level full for several batch sizes (RQ2 in small).

One local cluster (2 workers x 1 thread by default) and one resident model for all batch sizes:
``run_fever`` reuses the registered context, so each row times only the scoring. An untimed
warm-up run comes first: a worker's first forward passes are seconds slower than later ones. The same
claims (a label-stratified sample of the FEVER dev set when it is beside the repository, else
the demo set) under one template at every batch size.

Examples::

    python benchmarks/fever_batch_sizes.py --quick
    python benchmarks/fever_batch_sizes.py --claims 192 --sizes 1,8,32 --json sizes.json
"""

from __future__ import annotations

import _harness as h
from distributed import Client

import dask_pcm

COLUMNS = [
    ("batch_size", "batch", "d"),
    ("units", "tasks", "d"),
    ("wall_seconds", "wall_s", ".2f"),
    ("claims_per_second", "claims/s", ".2f"),
    ("accuracy", "accuracy", ".3f"),
]


def main() -> None:
    p = h.parser(__doc__.split("\n\n")[0])
    p.add_argument("--claims", type=int, help="claims to score (default 192, --quick 24)")
    p.add_argument("--sizes", default="1,8,32", help="comma-separated batch sizes")
    p.add_argument("--template", default="direct", help="built-in template name")
    args = p.parse_args()
    n = args.claims or (24 if args.quick else 192)
    sizes = [int(s) for s in args.sizes.split(",")]
    data = args.data or (h.DEFAULT_DATA if h.DEFAULT_DATA.is_file() else None)
    rows = []
    with (
        dask_pcm.local_cluster(n_workers=args.workers, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        # Untimed warm-up: a worker's first forward passes cost seconds more than later ones
        # (lazy initialisation in torch and transformers), which would land on the first size.
        dask_pcm.run_fever(
            data=data, model=args.model, templates=args.template, cluster=client,
            limit=4 * args.workers, batch_size=1, progress=False,
        )  # fmt: skip
        for size in sizes:
            with h.Timer() as wall:
                result = dask_pcm.run_fever(
                    data=data, model=args.model, templates=args.template, cluster=client,
                    limit=n, batch_size=size, progress=False,
                )  # fmt: skip
            rows.append(
                {
                    "batch_size": size,
                    "units": result.report["units"]["computed"],
                    "wall_seconds": wall.seconds,
                    "claims_per_second": len(result.predictions) / wall.seconds,
                    "accuracy": float(result.summary["accuracy"].iloc[0]),
                    "loads": sum(w["loads"] for w in result.report["workers"]),
                }
            )
            print(f"  batch {size}: {wall.seconds:.1f} s", flush=True)
    if len({r["loads"] for r in rows}) != 1:
        raise RuntimeError(f"the model was reloaded between batch sizes: {rows}")
    print()
    h.print_table(rows, COLUMNS)
    h.write_json(args.json, rows)


if __name__ == "__main__":
    main()
