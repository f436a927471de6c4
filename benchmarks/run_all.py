"""Run every benchmark, one after the other, and say which passed and how long each took.

Each script runs in its own process with the same ``--quick`` flag, writing its JSON (and PNG
plot) into ``--out`` (default: a temporary folder with ``--quick``, ``benchmarks/results``
otherwise). The scripts run one at a time: on a small machine any two would measure each
other. A script that fails does not stop the others; the exit status is non-zero if any
failed. With ``--quick`` the whole set is a smoke test (CI runs it, with ``--jobs 2``): every
script's small run, on the tiny random model (``--model tiny``, unless ``--model`` names
another), its figures not benchmarks; since they mean nothing, ``--jobs`` may run scripts side
by side then (about 4 minutes on 2 cores with 2, 6 to 7 one at a time). Without ``--quick`` it
is the full set of experiments behind ``benchmarks/README.md`` on the embedded SmolLM2-135M,
every comparison in 3 rounds (hours on 2 cores; ``--only`` picks scripts).

Examples::

    python benchmarks/run_all.py --quick
    python benchmarks/run_all.py --only levels,peers --out /tmp/bench
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _harness as h

HERE = Path(__file__).resolve().parent

# In the order of the paper's research questions, then the comparisons.
SCRIPTS = {
    "levels": "levels.py",  # RQ1: context levels, process per task, shared FS
    "batch_sizes": "batch_sizes.py",  # RQ2: batch sizes at partial and full
    "preemption": "preemption.py",  # RQ3: throughput under preemption
    "scale_out": "scale_out.py",  # RQ4: workers joining at once, peer to peer
    "broadcast": "scale_out.py --simulate",  # RQ4 at 256 workers, simulated time
    "scale_out_hosts": "scale_out.py --hosts",  # RQ4 between emulated hosts, link-bound (root)
    "peers": "peers.py",  # dask_pcm against Ray Data and plain Dask
    "scheduler_overhead": "scheduler_overhead.py",  # what the scheduler plugin costs
    "prefix": "prefix.py",  # FEVER claims/s with and without prompt-prefix reuse
    "paper_scale": "paper_scale.py",  # issue 19: 145,449 claims x 10 templates
    "startup": "startup.py",  # issue 32: time to first result of a fresh dask-pcm fever
    "first_answer": "first_answer.py",  # issue 41: first answer of a fresh dask-pcm batch
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
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="scripts run side by side (default 1; more only for --quick, whose timings mean "
        "nothing: side by side, scripts measure each other)",
    )
    p.set_defaults(workers=None)
    args = p.parse_args()
    if args.jobs < 1:
        p.error("--jobs must be 1 or more")
    if args.jobs > 1 and not args.quick:
        p.error("--jobs > 1 is for --quick only: benchmarks side by side measure each other")
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

    if args.jobs > 1:
        # Scripts running side by side must not race to build or convert the model.
        h.model_path(args)
    rows = []
    start = time.perf_counter()
    pending = list(names)
    running: dict[str, tuple[subprocess.Popen, Any, float, Path]] = {}
    with contextlib.ExitStack() as files:
        # An interrupted run stops the scripts it started instead of leaving them behind.
        files.callback(lambda: [proc.kill() for proc, *_ in running.values()])
        while pending or running:
            while pending and len(running) < args.jobs:
                name = pending.pop(0)
                target = out / f"{name}.json"
                script, *extra = SCRIPTS[name].split()
                cmd = [
                    sys.executable,
                    str(HERE / script),
                    *extra,
                    *passthrough,
                    "--json",
                    str(target),
                ]
                print(f"\n=== {name}: {' '.join(cmd[1:])}", flush=True)
                # One at a time, the script writes straight to this output; side by side, to a
                # file printed whole when it ends, so that logs do not interleave.
                log = None if args.jobs == 1 else files.enter_context(tempfile.TemporaryFile())
                proc = subprocess.Popen(
                    cmd, cwd=HERE, stdout=log, stderr=subprocess.STDOUT if log else None
                )
                running[name] = (proc, log, time.perf_counter(), target)
            time.sleep(0.2)
            for name, (proc, log, t0, target) in list(running.items()):
                if proc.poll() is None:
                    continue
                del running[name]
                if log is not None:
                    log.seek(0)
                    print(
                        f"\n=== {name} (output):\n{log.read().decode(errors='replace')}", flush=True
                    )
                rows.append(
                    {
                        "name": name,
                        "status": "ok"
                        if proc.returncode == 0
                        else f"FAILED (exit {proc.returncode})",
                        "seconds": time.perf_counter() - t0,
                        "json": str(target) if target.exists() else "-",
                        "returncode": proc.returncode,
                    }
                )
    rows.sort(key=lambda r: names.index(r["name"]))
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
