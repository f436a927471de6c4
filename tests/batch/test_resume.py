"""run_batch's output folder across runs, with a plain function: damaged and missing segments,
a bounded number of files, a resume with nothing left, folders that are not its own, two runs
on one folder, a whole run killed half way. Each fault is real: a file emptied, cut short or
deleted, a second process holding the folder, a process group sent SIGKILL."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import dask
import pandas as pd
import pytest

import dask_pcm
from dask_pcm.batch.segments import read_footer, read_index
from dask_pcm.batch.store import LOCK
from dask_pcm.exceptions import OutputFolderError
from tests.batch import paced_run

ROWS = [{"id": i} for i in range(60)]


def double(rows):
    return [{"id": r["id"], "double": 2 * r["id"]} for r in rows]


def _every_row_once(out: Path, rows: int = len(ROWS)) -> None:
    table = pd.read_parquet(out)
    assert sorted(table["id"]) == list(range(rows))
    assert (table["double"] == 2 * table["id"]).all()


def _no_cluster(monkeypatch) -> None:
    import dask_pcm.batch.cluster as clusters

    def refused(*args, **kwargs):
        raise AssertionError("a cluster was started with nothing to compute")

    monkeypatch.setattr(clusters, "open_client", refused)


@pytest.fixture
def client(make_cluster):
    return make_cluster()


@pytest.mark.parametrize("damage", ["zero-byte", "cut-short", "missing"])
def test_a_damaged_or_missing_segment_has_its_units_computed_again(
    client, tmp_path, caplog, damage
):
    """A crash or a full disk leaves a segment empty or cut short: it is set aside under a
    hidden name, with a warning naming it; a deleted one is named missing. Either way its
    units are computed again, and every other unit is kept."""
    out = tmp_path / "out"
    options = dict(cluster=client, rows_per_unit=10, output=out, progress=False)
    with dask.config.set({"pcm.batch.segment-rows": 20}):  # two units of 10 rows a segment
        dask_pcm.run_batch(double, ROWS, **options)
        part = sorted(out.glob("part-*.parquet"))[0]
        lost = len(read_footer(part).units)
        if damage == "missing":
            part.unlink()
        else:
            data = part.read_bytes()
            part.write_bytes(b"" if damage == "zero-byte" else data[: len(data) // 2])
        with caplog.at_level(logging.WARNING, logger="dask_pcm"):
            again = dask_pcm.run_batch(double, ROWS, **options)
    assert again.report["units"] == {
        "total": 6,
        "computed": lost,
        "reused": 6 - lost,
        "failed": 0,
        "unfinished": 0,
    }
    warned = [r.getMessage() for r in caplog.records if part.name in r.getMessage()]
    assert warned and ("is missing" in warned[0]) == (damage == "missing")
    aside = list(out.glob(f".{part.name}.unreadable-*"))  # kept, out of the way
    assert len(aside) == (damage != "missing")
    _every_row_once(out)


def test_units_go_into_a_bounded_number_of_files(client, tmp_path):
    """One file per unit was the old layout: 60 units wrote 60 files."""
    out = tmp_path / "out"
    with dask.config.set({"pcm.batch.tasks-in-flight": 2}):
        result = dask_pcm.run_batch(
            double, ROWS, cluster=client, rows_per_unit=1, output=out, progress=False
        )
    assert result.report["units"]["total"] == 60
    assert result.report["files"] == 1 and len(list(out.glob("*.parquet"))) == 1
    assert result.report["tasks"] < 60  # units are packed into tasks
    _every_row_once(out)


def test_a_resume_with_nothing_left_starts_no_cluster(client, tmp_path, monkeypatch):
    out = tmp_path / "out"
    first = dask_pcm.run_batch(
        double, ROWS, cluster=client, rows_per_unit=10, output=out, progress=False
    )
    _no_cluster(monkeypatch)
    again = dask_pcm.run_batch(double, ROWS, rows_per_unit=10, output=out, progress=False)
    assert again.report["units"] == {
        "total": 6,
        "computed": 0,
        "reused": 6,
        "failed": 0,
        "unfinished": 0,
    }
    assert again.report["workers"] == [] and again.report["tasks"] == 0
    assert again.to_pandas().equals(first.to_pandas())


def test_rows_of_a_deleted_folder_are_a_clear_error(client, tmp_path):
    out = tmp_path / "out"
    result = dask_pcm.run_batch(double, ROWS, cluster=client, output=out, progress=False)
    shutil.rmtree(out)
    with pytest.raises(OutputFolderError, match=r"output folder .*out does not exist"):
        result.to_pandas()


def _spark_folder(root: Path) -> dict[str, bytes]:
    """A dataset as Spark writes it (part files named by job uuid, ``.crc`` files,
    ``_SUCCESS``); returns every file's bytes."""
    import uuid

    root.mkdir(parents=True)
    job = uuid.uuid4()
    for i in range(3):
        name = f"part-{i:05d}-{job}-c000.snappy.parquet"
        pd.DataFrame({"id": [i], "text": ["theirs"]}).to_parquet(root / name, compression="snappy")
        (root / f".{name}.crc").write_bytes(b"crc")
    (root / "_SUCCESS").write_bytes(b"")
    return {p.name: p.read_bytes() for p in root.iterdir()}


def test_a_folder_dask_pcm_did_not_write_is_refused_and_left_alone(tmp_path, monkeypatch):
    """It used to be taken over: the user's part files renamed to hidden '.unreadable-'
    names as damaged segments."""
    out = tmp_path / "spark-output"
    before = _spark_folder(out)
    _no_cluster(monkeypatch)
    with pytest.raises(OutputFolderError) as caught:
        dask_pcm.run_batch(double, ROWS, output=out, progress=False)
    message = str(caught.value)
    assert str(out) in message and "not written by dask_pcm" in message
    assert "holds 7 file(s)" in message and "_SUCCESS" in message and "and 2 more" in message
    assert "give an empty or new folder" in message
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # no lock file either


def _indexed_units(out: Path) -> int:
    return sum(len(s.units) for s in read_index(out)[0].values())


def test_a_second_run_on_the_same_folder_fails_at_once(tmp_path, monkeypatch):
    """Two real runs on one folder: the second stops at once, naming the first's process,
    with no cluster started; the first completes, every row once."""
    out = tmp_path / "out"
    first = paced_run.start(
        out, env={"PACED_RUN_SECONDS": "0.01"}, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 60
        while not ((out / LOCK).exists() and (out / LOCK).read_text()):
            assert first.poll() is None, first.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "the first run never locked its folder"
            time.sleep(0.02)
        _no_cluster(monkeypatch)
        started = time.monotonic()
        with pytest.raises(OutputFolderError, match="in use by another run") as caught:
            dask_pcm.run_batch(double, ROWS, output=out, progress=False)
        assert time.monotonic() - started < 5
        assert f"pid {first.pid}" in str(caught.value)
        _, stderr = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    assert first.returncode == 0, stderr[-2000:]
    _every_row_once(out, 100)


def test_a_run_killed_half_way_resumes_with_every_row_once(tmp_path):
    """SIGKILL to a whole run (client, scheduler, worker process) part way; the same command
    again computes exactly the units not on disk, and the folder holds every row once."""
    out = tmp_path / "out"
    args = ["--rows", "600", "--rows-per-unit", "2"]
    flushed = {"DASK_PCM__BATCH__SEGMENT_ROWS": "20", "DASK_PCM__BATCH__FLUSH_INTERVAL": "0.2s"}
    paced = {**flushed, "PACED_RUN_SECONDS": "0.02"}
    run = paced_run.start(out, *args, env=paced, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while _indexed_units(out) < 20:
            assert run.poll() is None, run.communicate()[1].decode()[-2000:]
            assert time.monotonic() < deadline, "no units were written"
            time.sleep(0.05)
    finally:
        os.killpg(run.pid, signal.SIGKILL)
        run.wait()
    persisted = _indexed_units(out)
    assert persisted < 300, "the run finished before it was killed"
    report = tmp_path / "report.json"
    again = paced_run.start(out, *args, "--json", str(report), env=flushed, stderr=subprocess.PIPE)
    _, stderr = again.communicate(timeout=300)
    assert again.returncode == 0, stderr.decode()[-2000:]
    assert json.loads(report.read_text())["units"] == {
        "total": 300,
        "computed": 300 - persisted,
        "reused": persisted,
        "failed": 0,
        "unfinished": 0,
    }
    _every_row_once(out, 600)
