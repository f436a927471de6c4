"""A FEVER run as a user's client process would make it, for the emulated hosts' tests: run in
a host of its own, so that its link to the scheduler can be cut.

    python tests/hosts/fever_client.py SCHEDULER CLAIMS MODEL OUTPUT

Prints the run's unit counts as one JSON line and exits 0, or prints ``ERROR <type>: <message>``
and exits 1.
"""

from __future__ import annotations

import json
import sys
import traceback


def main(scheduler: str, claims: str, model: str, output: str) -> int:
    from dask_pcm.apps.fever.run import run_fever

    try:
        result = run_fever(
            claims,
            model=model,
            templates=["direct"],
            cluster=scheduler,
            claims_per_task=4,
            output=output,
            progress=False,
        )
    except Exception as exc:
        traceback.print_exc()  # for the log; the last line is what the test reads
        sys.stderr.flush()
        print(f"ERROR {type(exc).__name__}: {exc}", flush=True)
        return 1
    print(json.dumps(result.report["units"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:5]))
