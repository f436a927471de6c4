"""run_fever's output folder under faults: provenance-keyed resume, a lock, damaged parts."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import dask
import pandas as pd
import pytest

import dask_pcm
from dask_pcm.apps.fever.run import run_fever
from dask_pcm.batch import content_digest as model_digest
from dask_pcm.batch.segments import INDEX
from dask_pcm.batch.store import LOCK
from dask_pcm.exceptions import FeverFormatError, OutputFolderError


@pytest.fixture
def client(inproc_cluster):
    return inproc_cluster[1]


@pytest.fixture
def model(tiny_model_dir: Path, tmp_path: Path) -> Path:
    """A copy of the tiny model the test may change."""
    return Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))


def _run(client, model, out, **kwargs):
    options = {"num_templates": 2, "claims_per_task": 10, "progress": False, **kwargs}
    return run_fever(model=model, cluster=client, output=out, **options)


def test_rows_carry_the_model_digest_and_the_same_model_by_a_relative_path_resumes(
    client, model, tmp_path, monkeypatch
):
    out = tmp_path / "preds.parquet"
    first = _run(client, model, out)
    assert set(first.predictions["model_digest"]) == {model_digest(dask_pcm.causal_lm(model))}
    monkeypatch.chdir(tmp_path)
    again = _run(client, "model", "preds.parquet")  # the same files, named another way
    assert again.report["units"] == {"total": 6, "computed": 0, "reused": 6, "failed": 0}
    assert len(again.predictions) == 60


def test_changed_model_files_at_the_same_path_refuse_to_resume(client, model, tmp_path):
    """Rewriting the model behind the same path must not mix old and new predictions."""
    out = tmp_path / "preds.parquet"
    _run(client, model, out)
    config = model / "config.json"
    config.write_text(config.read_text() + "\n")  # other bytes, same path
    with pytest.raises(
        OutputFolderError, match=r"context 'fever-llm': its files changed"
    ) as caught:
        _run(client, model, out)
    assert str(out) in str(caught.value) and "delete" in str(caught.value)
    assert len(pd.read_parquet(out)) == 60  # nothing added to the folder


def test_a_changed_template_refuses_to_resume_and_names_it(client, model, tmp_path):
    out = tmp_path / "preds.parquet"
    mine = tmp_path / "mine.json"
    mine.write_text('[{"name": "mine", "text": "Claim: {claim}\\nAnswer:"}]')
    _run(client, model, out, templates=str(mine), limit=6)
    mine.write_text('[{"name": "mine", "text": "Statement: {claim}\\nAnswer:"}]')
    with pytest.raises(OutputFolderError, match=r"template 'mine' changed \(text\)"):
        _run(client, model, out, templates=str(mine), limit=6)


def test_a_zero_byte_segment_is_set_aside_and_its_units_computed_again(
    client, model, tmp_path, caplog
):
    out = tmp_path / "preds.parquet"
    with dask.config.set({"pcm.batch.segment-rows": 20}):  # 2 units of 10 rows per segment
        _run(client, model, out)
        part = sorted(out.glob("*.parquet"))[0]
        part.write_bytes(b"")  # a crash or a full disk
        with caplog.at_level(logging.WARNING, logger="dask_pcm"):
            again = _run(client, model, out)
    assert again.report["units"] == {"total": 6, "computed": 2, "reused": 4, "failed": 0}
    assert any(part.name in r.getMessage() for r in caplog.records)
    assert [p.name for p in out.glob(f".{part.name}.unreadable-*")]  # kept, out of the way
    table = pd.read_parquet(out)
    assert len(table) == 60 and not table.duplicated(["claim_id", "template"]).any()


def test_a_segment_written_but_not_indexed_counts_as_done(client, model, tmp_path):
    """A run killed between renaming a segment into place and indexing it: the segment's
    footer says which units it holds; none is computed again, no row is doubled."""
    out = tmp_path / "preds.parquet"
    with dask.config.set({"pcm.batch.segment-rows": 20}):
        _run(client, model, out)
        index = out / INDEX
        lines = index.read_text().splitlines()
        index.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:15])  # half a last line
        again = _run(client, model, out)
    assert again.report["units"] == {"total": 6, "computed": 0, "reused": 6, "failed": 0}
    assert len(pd.read_parquet(out)) == 60
    assert len(index.read_text().splitlines()) == 3  # rewritten whole, one line per segment


def test_a_missing_segment_is_computed_again(client, model, tmp_path, caplog):
    out = tmp_path / "preds.parquet"
    with dask.config.set({"pcm.batch.segment-rows": 20}):
        _run(client, model, out)
        sorted(out.glob("*.parquet"))[-1].unlink()
        with caplog.at_level(logging.WARNING, logger="dask_pcm"):
            again = _run(client, model, out)
    assert again.report["units"] == {"total": 6, "computed": 2, "reused": 4, "failed": 0}
    assert any("is missing" in r.getMessage() for r in caplog.records)
    assert len(pd.read_parquet(out)) == 60


def test_units_go_into_a_bounded_number_of_files(client, model, tmp_path):
    """One file per unit was the old layout: 60 units wrote 60 files."""
    out = tmp_path / "preds.parquet"
    with dask.config.set({"pcm.batch.tasks-in-flight": 2}):
        result = _run(client, model, out, claims_per_task=1)
    assert result.report["units"]["total"] == 60
    assert result.report["files"] == 1 and len(list(out.glob("*.parquet"))) == 1
    assert result.report["tasks"] < 60  # units are packed into tasks
    assert len(pd.read_parquet(out)) == 60


def test_a_resume_with_nothing_left_starts_no_cluster(model, tmp_path, monkeypatch, client):
    import dask_pcm.batch.cluster as run_module

    out = tmp_path / "preds.parquet"
    first = _run(client, model, out)

    def no_cluster(*args, **kwargs):
        raise AssertionError("a cluster was started with nothing to compute")

    monkeypatch.setattr(run_module, "open_client", no_cluster)
    again = run_fever(model=model, output=out, num_templates=2, claims_per_task=10, progress=False)
    assert again.report["units"] == {"total": 6, "computed": 0, "reused": 6, "failed": 0}
    assert again.report["workers"] == [] and again.report["tasks"] == 0
    assert again.summary.equals(first.summary)


def test_temporary_files_of_a_killed_run_are_removed(client, model, tmp_path):
    out = tmp_path / "preds.parquet"
    _run(client, model, out)
    stale = out / ".part-000000.parquet.4242.0123abcd.tmp"  # what a killed run leaves
    stale.write_bytes(b"half a parquet file")
    _run(client, model, out)
    assert not stale.exists()


def test_a_template_name_that_escapes_the_folder_is_refused(client, model, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('[{"name": "./../x", "text": "Claim: {claim}\\nAnswer:"}]')
    with pytest.raises(FeverFormatError, match=r"bad.json: template 1: template name '\./\.\./x'"):
        _run(client, model, tmp_path / "out" / "preds", templates=str(bad))
    assert not list(tmp_path.glob("**/x--*"))


def test_a_second_run_on_the_same_folder_fails_at_once(model, tmp_path):
    """Two real runs on one folder: the second stops at once, naming the first; the first
    completes, every row once."""
    out = tmp_path / "preds.parquet"
    cmd = [
        sys.executable, "-m", "dask_pcm.cli", "fever", "--model", str(model), "--workers", "1",
        "--num-templates", "2", "--claims-per-task", "10", "--output", str(out),
    ]  # fmt: skip
    first = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not ((out / LOCK).exists() and (out / LOCK).read_text()):
            assert first.poll() is None, first.communicate()[0]
            assert time.monotonic() < deadline, "the first run never locked its folder"
            time.sleep(0.02)
        started = time.monotonic()
        second = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert second.returncode != 0
        assert time.monotonic() - started < 30  # no cluster started, no model loaded
        assert "in use by another run" in second.stderr
        assert f"pid {first.pid}" in second.stderr
        assert "Traceback" not in second.stderr
        output, _ = first.communicate(timeout=180)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, output
    table = pd.read_parquet(out)
    assert len(table) == 60 and not table.duplicated(["claim_id", "template"]).any()


def test_workers_below_one_is_a_clear_error_not_a_hang(tmp_path):
    import dask_pcm

    done = subprocess.run(
        [sys.executable, "-m", "dask_pcm.cli", "fever", "--workers", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "--workers" in done.stderr and "Traceback" not in done.stderr
    with pytest.raises(ValueError, match="workers must be at least 1"):
        run_fever(workers=-1, progress=False)
    with pytest.raises(ValueError, match=r"n_workers must be 0 .* or more"):
        dask_pcm.local_cluster(n_workers=-1)


def test_a_damaged_weights_file_names_the_users_path_and_the_workers_copy(model):
    from click.testing import CliRunner

    from dask_pcm.cli import main

    with open(model / "model.safetensors", "r+b") as f:
        f.write(b"\xff" * 8)  # the header length: garbage
    args = ["fever", "--model", str(model), "--workers", "1", "--num-templates", "1"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code != 0
    assert "Traceback" not in result.output
    assert f"this worker's copy of '{model}'" in result.output
    assert os.sep + "pcm-templates" + os.sep in result.output  # the copy it built from


def _indexed_units(out: Path) -> int:
    from dask_pcm.batch.segments import read_index

    return sum(len(s.units) for s in read_index(out)[0].values())


def test_a_run_killed_half_way_resumes_with_every_row_once(model, tmp_path):
    """SIGKILL to a whole CLI run (client, scheduler, workers) part way; the same command
    again computes exactly the units not on disk, and the folder holds every row once."""
    import json
    import signal

    from dask_pcm.apps.fever import demo_claims

    pool = demo_claims().claims
    data = tmp_path / "claims.jsonl"
    data.write_text(
        "".join(
            json.dumps({"id": i, "label": pool[i % 30].label, "claim": pool[i % 30].claim}) + "\n"
            for i in range(600)
        )
    )
    out = tmp_path / "preds.parquet"
    cmd = [
        sys.executable, "-m", "dask_pcm.cli", "fever", "--model", str(model), "--workers", "1",
        "--templates", "direct", "--claims-per-task", "2", "--data", str(data),
        "--output", str(out),
    ]  # fmt: skip
    env = {
        **os.environ,
        "DASK_PCM__FEVER__SEGMENT_ROWS": "20",
        "DASK_PCM__FEVER__FLUSH_INTERVAL": "0.2s",
    }
    run = subprocess.Popen(
        cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
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
    again = subprocess.run(
        [*cmd, "--json", str(tmp_path / "r.json")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0, again.stderr[-2000:]
    report = json.loads((tmp_path / "r.json").read_text())["report"]
    assert report["units"] == {
        "total": 300,
        "computed": 300 - persisted,
        "reused": persisted,
        "failed": 0,
    }
    table = pd.read_parquet(out)
    assert len(table) == 600 and not table.duplicated(["claim_id", "template"]).any()


def test_predictions_of_a_deleted_folder_are_a_clear_error(client, model, tmp_path):
    out = tmp_path / "preds.parquet"
    result = _run(client, model, out)
    shutil.rmtree(out)
    with pytest.raises(OutputFolderError, match=r"preds.parquet does not exist"):
        result.predictions  # noqa: B018 (read when first used)


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


def test_a_folder_dask_pcm_did_not_write_is_refused_and_left_alone(model, tmp_path):
    """It used to be taken over: the user's part files renamed to hidden '.unreadable-'
    names as damaged segments."""
    out = tmp_path / "spark-output"
    before = _spark_folder(out)
    with pytest.raises(OutputFolderError) as caught:
        run_fever(model=model, output=out, num_templates=1, progress=False)
    message = str(caught.value)
    assert str(out) in message and "not written by dask_pcm" in message
    assert "holds 7 file(s)" in message and "_SUCCESS" in message and "and 2 more" in message
    assert "give an empty or new folder" in message
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # no lock file either
