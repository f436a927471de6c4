"""run_fever's output folder and arguments: the model and templates in the provenance, a
resume refused when they change, bad names and arguments, a damaged weights file. What the
batch layer guarantees of any folder (damaged and missing segments, the lock, a killed run,
folders not its own) is tested with plain functions in tests/batch."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

import dask_pcm
from dask_pcm.apps.fever.errors import FeverFormatError
from dask_pcm.apps.fever.run import run_fever
from dask_pcm.batch import content_digest as model_digest
from dask_pcm.exceptions import OutputFolderError


@pytest.fixture
def client(make_cluster):
    return make_cluster(n_workers=2)


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
    assert again.report["units"] == {
        "total": 6,
        "computed": 0,
        "reused": 6,
        "failed": 0,
        "unfinished": 0,
    }
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


def test_a_template_name_that_escapes_the_folder_is_refused(client, model, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('[{"name": "./../x", "text": "Claim: {claim}\\nAnswer:"}]')
    with pytest.raises(FeverFormatError, match=r"bad.json: template 1: template name '\./\.\./x'"):
        _run(client, model, tmp_path / "out" / "preds", templates=str(bad))
    assert not list(tmp_path.glob("**/x--*"))


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
