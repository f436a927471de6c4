"""``run_batch`` over numbered rows with a plain function, as a user's script runs it: the
real process that tests in tests/batch kill, signal, and run twice on one folder.

    python tests/batch/paced_run.py OUTPUT [--rows N] [--rows-per-unit N] [--json FILE]

It starts its own local cluster of one worker process (``workers=1``) and shows the
progress bar on standard error. Each unit sleeps ``PACED_RUN_SECONDS`` seconds (environment,
default 0) so that a test can catch the run part way; the pace changes no result and is no
part of the provenance, so a rerun without it resumes. The function is recorded by a
version of its own (:data:`PROVENANCE`), not by its code digest, which names its module
(``__main__`` here): a test may resume the folder in its own process with
:func:`resume`. Interrupted (SIGTERM, Ctrl-C), the script exits with 128 plus the signal's
number, as a shell reports a process so ended.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

import dask_pcm
from dask_pcm.interrupts import exit_status

PROVENANCE = {"function": "paced_run.double/1"}


def double(rows):
    time.sleep(float(os.environ.get("PACED_RUN_SECONDS", "0")))
    return [{"id": r["id"], "double": 2 * r["id"]} for r in rows]


def run(output: str | os.PathLike[str], rows: int, rows_per_unit: int, **options: Any) -> Any:
    """``run_batch`` of :func:`double` over ``rows`` numbered rows into ``output``."""
    data = [{"id": i} for i in range(rows)]
    return dask_pcm.run_batch(
        double, data, rows_per_unit=rows_per_unit, output=output, provenance=PROVENANCE,
        **options,
    )  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("output")
    parser.add_argument("--rows", type=int, default=100)
    parser.add_argument("--rows-per-unit", type=int, default=1)
    parser.add_argument("--json", default=None, help="write the run's report here")
    args = parser.parse_args()
    try:
        result = run(args.output, args.rows, args.rows_per_unit, workers=1)
    except KeyboardInterrupt as exc:
        print(f"interrupted: {type(exc).__name__}", file=sys.stderr)
        return exit_status(exc)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.report, f)
    return 0


def resume(output: str | os.PathLike[str], rows: int, rows_per_unit: int, client: Any) -> Any:
    """What the script's run on ``output`` left, resumed in this process on ``client``."""
    return run(output, rows, rows_per_unit, cluster=client, progress=False)


def start(
    output: str | os.PathLike[str], *args: str, env: dict[str, str] | None = None, **popen: Any
) -> subprocess.Popen:
    """This script on ``output`` with ``args``, in a process group of its own (its cluster's
    worker processes join it), ``env`` added to the environment; ``popen`` as for Popen."""
    return subprocess.Popen(
        [sys.executable, __file__, os.fspath(output), *args],
        env={**os.environ, **(env or {})},
        start_new_session=True,
        **popen,
    )


if __name__ == "__main__":  # the local cluster's worker processes import this file again
    sys.exit(main())
