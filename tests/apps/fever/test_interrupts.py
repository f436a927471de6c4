"""``dask-pcm fever --output DIR`` stopped by SIGTERM (``kill PID``, a walltime, ``docker
stop``) or SIGINT: the finished units still in memory are written, the command says so and
exits 143 or 130, no worker process is left, and the same command resumes to every row once."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dask_pcm.batch.store import read_predictions

CLAIMS = 100
TEMPLATES = ["direct", "yes-no"]
# Only the final flush writes (a segment holds every row; no timed flush), and one unit
# per task, one task at a time: about 50 units a second on the tiny model, so that the run
# is still going when the signal comes.
PACED = {
    "DASK_PCM__FEVER__FLUSH_INTERVAL": "1h",
    "DASK_PCM__FEVER__TASKS_IN_FLIGHT": "1",
    "DASK_PCM__FEVER__TASK_SECONDS": "1ms",
}
PROGRESS = re.compile(r"units:.*?\| *(\d+)/(\d+) \[")


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


class _Stderr:
    """Everything the process writes on standard error, read as it comes (tqdm's bar
    rewrites its line with carriage returns, never a newline)."""

    def __init__(self, process: subprocess.Popen) -> None:
        self._chunks: list[bytes] = []
        assert process.stderr is not None
        self._pipe = process.stderr
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while chunk := os.read(self._pipe.fileno(), 65536):
            self._chunks.append(chunk)

    def text(self) -> str:
        return b"".join(self._chunks).decode(errors="replace")

    def units_done(self) -> int:
        found = PROGRESS.findall(self.text())
        return int(found[-1][0]) if found else 0

    def finish(self) -> str:
        self._thread.join(timeout=30)
        return self.text()


def _group_gone(pgid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow  # two CLI runs with their clusters: 17 to 26 s on 2 shared cores
@pytest.mark.parametrize(("signum", "status"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signalled_run_writes_its_finished_units_and_resumes(
    tiny_model_dir, tmp_path, signum, status
):
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
    stderr = _Stderr(run)
    try:
        deadline = time.monotonic() + 120
        while stderr.units_done() < 5:
            assert run.poll() is None, stderr.finish()[-2000:]
            assert time.monotonic() < deadline, "no units finished"
            time.sleep(0.02)
        run.send_signal(signum)  # the command's process only, as `kill PID` does
        seen = stderr.units_done()
        run.wait(timeout=120)
        text = stderr.finish()
        # Signalled, it ended its local cluster itself.
        assert _group_gone(run.pid, 30), "worker processes outlived the command"
    finally:
        if run.poll() is None or not _group_gone(run.pid, 0.1):
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
    assert run.returncode == status, text[-2000:]
    name = signal.Signals(signum).name
    assert (
        f"Interrupted ({name}): finished units are in {out}; run the same command again to resume"
        in text
    )
    assert "Aborted!" not in text and "Traceback" not in text
    kept = read_predictions(out)
    # Nothing was written before the signal (the flush interval is an hour): every unit the
    # bar had counted was written as the run unwound.
    assert seen <= len(kept) < CLAIMS * len(TEMPLATES), "the run was not interrupted part way"

    again = subprocess.run(
        [*cmd, "--json", str(tmp_path / "r.json")],
        env={**os.environ, "DASK_PCM__FEVER__FLUSH_INTERVAL": "1h"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0, again.stderr[-2000:]
    report = json.loads((tmp_path / "r.json").read_text())["report"]
    assert report["units"]["reused"] == len(kept)
    table = read_predictions(out)
    assert not table.duplicated(["claim_id", "template"]).any()
    assert set(zip(table["claim_id"].astype(str), table["template"], strict=True)) == {
        (str(i), t) for i in range(CLAIMS) for t in TEMPLATES
    }
