"""``dask-pcm fever --output DIR`` stopped by SIGTERM (``kill PID``, a walltime, ``docker
stop``): the command says where the finished units are and how to resume, and exits 143, not
with click's "Aborted!" or a traceback; no worker process is left. What run_batch does with
the signal (SIGTERM and SIGINT: finished units written, the cluster closed, a rerun resuming
to every row once) is tested with a plain function in tests/batch/test_interrupts.py. SIGTERM
is raised as a ``KeyboardInterrupt`` (tests/test_interrupts.py), so Ctrl-C takes the same
path through the command."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from dask_pcm.batch.store import read_predictions
from tests.conftest import StderrReader, signal_after_units

CLAIMS = 100
TEMPLATES = ["direct", "yes-no"]
# Only the final flush writes (a segment holds every row; no timed flush), and one unit
# per task, one task at a time: about 50 units a second on the tiny model, so that the run
# is still going when the signal comes.
PACED = {
    "DASK_PCM__BATCH__FLUSH_INTERVAL": "1h",
    "DASK_PCM__BATCH__TASKS_IN_FLIGHT": "1",
    "DASK_PCM__BATCH__TASK_SECONDS": "1ms",
}


def _claims(path: Path) -> Path:
    labels = ["SUPPORTS", "REFUTES", "NOT ENOUGH INFO"]
    path.write_text(
        "".join(
            json.dumps({"id": i, "label": labels[i % 3], "claim": f"Claim {i} is about {i * 7}."})
            + "\n"
            for i in range(CLAIMS)
        )
    )
    return path


def test_a_terminated_run_says_where_its_finished_units_are_and_exits_143(tiny_model_dir, tmp_path):
    out = tmp_path / "preds.parquet"
    cmd = [
        sys.executable, "-m", "dask_pcm.cli", "fever", "--data", str(_claims(tmp_path / "c.jsonl")),
        "--model", str(tiny_model_dir), "--templates", ",".join(TEMPLATES),
        "--claims-per-task", "1", "--workers", "1", "--output", str(out),
    ]  # fmt: skip
    run = subprocess.Popen(
        cmd,
        env={**os.environ, **PACED},
        start_new_session=True,  # its own process group: the workers are found and ended
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    stderr = StderrReader(run)
    seen, text = signal_after_units(run, stderr, signal.SIGTERM)
    assert run.returncode == 143, text[-2000:]
    assert (
        f"Interrupted (SIGTERM): finished units are in {out}; run the same command again to "
        "resume" in text
    )
    assert "Aborted!" not in text and "Traceback" not in text
    assert seen <= len(read_predictions(out)) < CLAIMS * len(TEMPLATES)
