"""Run every benchmark, one after the other, and say which passed and how long each took.

Each script runs in its own process with the same ``--quick`` flag, writing its JSON (and PNG
plot) into ``--out`` (default: a temporary folder with ``--quick``, ``benchmarks/results``
otherwise). The scripts run one at a time: on a small machine any two would measure each
other. A script that fails does not stop the others; the exit status is non-zero if any
failed. With ``--quick`` the whole set is a smoke test (CI runs it): every script's small
run, on the tiny random model (``--model tiny``, unless ``--model`` names another), in about
about six minutes on 2 cores; its figures are not benchmarks. Without ``--quick`` it is the full set
of experiments behind ``benchmarks/README.md`` on the embedded SmolLM2-135M (an hour or more on
2 cores).

Examples::

    python benchmarks/run_all.py --quick
    python benchmarks/run_all.py --only levels,peers --out /tmp/bench
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _harness as h

HERE = Path(__file__).resolve().parent

# In the order of the paper's research questions, then the comparisons.
SCRIPTS = {
    "levels": "levels.py",  # RQ1: context levels, process per task, shared FS
    "batch_sizes": "batch_sizes.py",  # RQ2: batch sizes at partial and full
    "preemption": "preemption.py",  # RQ3: throughput under preemption
    "scale_out": "scale_out.py",  # RQ4: workers joining at once, peer to peer
    "broadcast": "scale_out.py --simulate",  # RQ4 at 256 workers, simulated time
    "peers": "peers.py",  # dask_pcm against Ray Data and plain Dask
    "scheduler_overhead": "scheduler_overhead.py",  # what the scheduler plugin costs
    "prefix": "prefix.py",  # FEVER claims/s with and without prompt-prefix reuse
    "paper_scale": "paper_scale.py",  # issue 19: 145,449 claims x 10 templates
}

COLUMNS = [
    ("name", "benchmark", "s"),
    ("status", "status", "s"),
    ("seconds", "seconds", ".1f"),
    ("json", "results", "s"),
]


def main() -> None:
    p = h.parser(__doc__.split("\n\n")[0])
    p.add_argument("--only", help=f"comma-separated subset of {','.join(SCRIPTS)}")
    p.add_argument("--out", type=Path, help="folder for every script's JSON and PNG")
    p.set_defaults(workers=None)
    args = p.parse_args()
    names = args.only.split(",") if args.only else list(SCRIPTS)
    unknown = [n for n in names if n not in SCRIPTS]
    if unknown:
        p.error(f"unknown benchmark(s) {unknown}; choose from {', '.join(SCRIPTS)}")
    out = args.out or (
        Path(tempfile.mkdtemp(prefix="dask-pcm-bench-")) if args.quick else HERE / "results"
    )
    out.mkdir(parents=True, exist_ok=True)
    passthrough = ["--quick"] if args.quick else []
    if args.workers is not None:  # else each script's own default (preemption.py: 4)
        passthrough += ["--workers", str(args.workers)]
    if args.repetitions is not None:
        passthrough += ["--repetitions", str(args.repetitions)]
    passthrough += ["--seed", str(args.seed)]
    if args.model or args.quick:
        # A smoke run checks that every script runs end to end, not how fast: on the tiny
        # random model it fits in a few minutes.
        passthrough += ["--model", args.model or h.TINY]
    if args.data:
        passthrough += ["--data", str(args.data)]

    rows = []
    start = time.perf_counter()
    for name in names:
        target = out / f"{name}.json"
        script, *extra = SCRIPTS[name].split()
        cmd = [sys.executable, str(HERE / script), *extra, *passthrough, "--json", str(target)]
        print(f"\n=== {name}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.run(cmd, cwd=HERE).returncode
        rows.append(
            {
                "name": name,
                "status": "ok" if rc == 0 else f"FAILED (exit {rc})",
                "seconds": time.perf_counter() - t0,
                "json": str(target) if target.exists() else "-",
                "returncode": rc,
            }
        )
    print(
        f"\nall benchmarks ({'quick' if args.quick else 'full'}) in "
        f"{time.perf_counter() - start:.0f} s, results in {out}"
    )
    h.print_table(rows, COLUMNS)
    h.write_json(args.json, rows)
    failed = [r["name"] for r in rows if r["returncode"]]
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
