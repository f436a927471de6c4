"""A script running ``run_batch`` stopped by SIGTERM (``kill PID``, a walltime, ``docker
stop``) or SIGINT (Ctrl-C): run_batch raises (:class:`~dask_pcm.interrupts.Terminated` for
SIGTERM, a ``KeyboardInterrupt``) after writing the finished units still in memory and
closing the local cluster it started, and the same script resumes to every row once."""

from __future__ import annotations

import signal
import subprocess

import pytest

from dask_pcm.batch.segments import read_predictions
from tests.batch import paced_run
from tests.conftest import StderrReader, signal_after_units

ROWS = 100
# Only the run's last flush writes (no timed flush), and one unit per task, one task at a
# time, each sleeping 50 ms: the run is still going when the signal comes.
PACED = {
    "DASK_PCM__BATCH__FLUSH_INTERVAL": "1h",
    "DASK_PCM__BATCH__TASKS_IN_FLIGHT": "1",
    "DASK_PCM__BATCH__TASK_SECONDS": "1ms",
    "PACED_RUN_SECONDS": "0.05",
}


@pytest.mark.parametrize(
    ("signum", "raised"),
    [(signal.SIGTERM, "Terminated"), (signal.SIGINT, "KeyboardInterrupt")],
    ids=["SIGTERM", "SIGINT"],
)
def test_a_signalled_run_writes_its_finished_units_and_resumes(
    make_cluster, tmp_path, signum, raised
):
    out = tmp_path / "out"
    args = ["--rows", str(ROWS)]
    run = paced_run.start(out, *args, env=PACED, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    stderr = StderrReader(run)
    seen, text = signal_after_units(run, stderr, signum)
    assert run.returncode == 128 + signum, text[-2000:]
    assert f"interrupted: {raised}" in text and "Traceback" not in text
    kept = read_predictions(out)
    # Nothing was written before the signal (the flush interval is an hour): every unit the
    # bar had counted was written as the run unwound.
    assert seen <= len(kept) < ROWS, "the run was not interrupted part way"

    # Resumed (in this process: the script records its function by a version of its own).
    again = paced_run.resume(out, ROWS, 1, make_cluster())
    assert again.report["units"]["reused"] == len(kept)
    assert again.report["units"]["computed"] == ROWS - len(kept)
    table = read_predictions(out)
    assert sorted(table["id"]) == list(range(ROWS))
    assert (table["double"] == 2 * table["id"]).all()
