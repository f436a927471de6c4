"""The scripts in examples/, run as a user would: killed part way, then run to the end.

Each runs as its own process group on a tiny model, is sent SIGKILL once some units are in
its output folder (client, scheduler and workers die together, as on a lost node), and then
runs again with the same command: every row is in the folder once, and the second run
computed only the units the first had not written."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from dask_pcm.batch.segments import read_index, read_predictions

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
ROWS, ROWS_PER_UNIT = 400, 4  # the examples' unit size; enough units for a "part way"
UNITS = ROWS // ROWS_PER_UNIT
KILL_AFTER = 5  # units indexed; the tiny models write the rest within a second or two


def _environment(tmp_path: Path) -> dict[str, str]:
    return {
        **os.environ,
        "TMPDIR": str(tmp_path),  # the examples' default files, and the workers' folders
        "DASK_PCM__BATCH__FLUSH_INTERVAL": "0",  # every finished unit reaches the disk
        "DASK_PCM__WORKER__TEMPLATE_DIRECTORY": str(tmp_path / "worker-templates"),
    }


def _kill_part_way(cmd: list[str], out: Path, env: dict[str, str], log: Path) -> int:
    """Start ``cmd``, SIGKILL its process group once units are in ``out``; the units left."""
    with log.open("wb") as sink:
        run = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=sink, stderr=sink)
    try:
        deadline = time.monotonic() + 60
        while sum(len(s.units) for s in read_index(out)[0].values()) < KILL_AFTER:
            assert run.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, f"{KILL_AFTER} units were not written in 60 s"
            time.sleep(0.02)
    finally:
        os.killpg(run.pid, signal.SIGKILL)
        run.wait()
    # What a resume finds: every whole segment (written atomically), not only those indexed.
    rows = len(pd.read_parquet(out))
    assert rows % ROWS_PER_UNIT == 0 and 0 < rows < ROWS, f"{rows} rows after the kill"
    print(f"killed with {rows // ROWS_PER_UNIT} of {UNITS} units on disk")
    return rows // ROWS_PER_UNIT


def _run_to_the_end(cmd: list[str], env: dict[str, str]) -> str:
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _counts(stdout: str) -> tuple[int, int, int]:
    found = re.search(r"units: (\d+) computed, (\d+) reused of (\d+)", stdout)
    assert found, stdout
    computed, reused, total = map(int, found.groups())
    return computed, reused, total


def _every_row_once(out: Path) -> pd.DataFrame:
    rows = read_predictions(out)
    assert sorted(rows["id"]) == list(range(ROWS))
    return rows


def _killed_and_resumed(
    script: str, out: Path, tmp_path: Path, *options: str
) -> tuple[pd.DataFrame, str]:
    """Run ``examples/script`` with ``options`` and one worker, kill it part way, run it to
    the end: its rows (every one once) and the second run's output."""
    env = _environment(tmp_path)
    cmd = [sys.executable, str(EXAMPLES / script), "--output", str(out), "--workers", "1"]
    cmd += options
    kept = _kill_part_way(cmd, out, env, tmp_path / "first.log")
    stdout = _run_to_the_end(cmd, env)
    assert _counts(stdout) == (UNITS - kept, kept, UNITS)
    return _every_row_once(out), stdout


@pytest.mark.slow
@pytest.mark.soak  # a run killed part way, then run again
def test_generate_jsonl_killed_part_way_resumes_with_every_row_once(tiny_model_dir, tmp_path):
    out, env = tmp_path / "answers", _environment(tmp_path)
    cmd = [
        sys.executable, str(EXAMPLES / "generate_jsonl.py"), "--output", str(out),
        "--model", str(tiny_model_dir), "--rows", str(ROWS), "--workers", "1",
    ]  # fmt: skip
    kept = _kill_part_way(cmd, out, env, tmp_path / "first.log")
    stdout = _run_to_the_end(cmd, env)
    assert _counts(stdout) == (UNITS - kept, kept, UNITS)
    rows = _every_row_once(out)
    assert rows["text"].map(type).eq(str).all() and rows["prompt"].str.startswith("Tell").all()
    assert "400 answers in" in stdout and "  0: 'Tell me about Paris:' -> " in stdout


@pytest.mark.slow
@pytest.mark.soak  # a run killed part way, then run again
def test_embed_corpus_killed_part_way_resumes_with_every_row_once(tmp_path):
    out, env = tmp_path / "embeddings", _environment(tmp_path)
    cmd = [
        sys.executable, str(EXAMPLES / "embed_corpus.py"), "--output", str(out),
        "--rows", str(ROWS), "--workers", "1",
    ]  # fmt: skip
    kept = _kill_part_way(cmd, out, env, tmp_path / "first.log")
    stdout = _run_to_the_end(cmd, env)
    assert _counts(stdout) == (UNITS - kept, kept, UNITS)
    rows = _every_row_once(out)
    assert rows["embedding"].map(len).eq(32).all()
    assert "400 embeddings of dimension 32 in" in stdout
    assert re.search(r"nearest to 'Paris is number 0\.' \(cosine\):\n  \d\.\d{3} '", stdout)
    # The encoder's subfolders travelled to the worker with the rest of its tree.
    copies = tmp_path / "worker-templates"
    assert list(copies.glob("**/1_Pooling/config.json"))
    assert list(copies.glob("**/tokenizer/tokenizer.json"))


@pytest.mark.slow
@pytest.mark.soak  # a run killed part way, then run again
def test_retrieve_faiss_killed_part_way_resumes_with_every_row_once(tmp_path):
    rows, _ = _killed_and_resumed(
        "retrieve_faiss.py", tmp_path / "neighbours", tmp_path,
        "--queries", str(ROWS), "--passages", "300", "--k", "3",
    )  # fmt: skip
    assert rows["passages"].map(len).eq(3).all()
    assert rows["passages"].map(lambda p: all(x.startswith("p") for x in p)).all()
    scores = rows["scores"].map(list)
    assert scores.map(lambda s: s == sorted(s, reverse=True) and s[0] <= 1.0001).all()
    # One context, one template: the index and the encoder's subfolders travelled together.
    copies = tmp_path / "worker-templates"
    assert list(copies.glob("**/index.faiss"))
    assert list(copies.glob("**/encoder/tokenizer/tokenizer.json"))


@pytest.mark.slow
@pytest.mark.soak  # a run killed part way, then run again
def test_score_sklearn_killed_part_way_resumes_with_every_row_once(tmp_path):
    rows, stdout = _killed_and_resumed(
        "score_sklearn.py", tmp_path / "scores", tmp_path, "--rows", str(ROWS)
    )
    assert set(rows["predicted"]) == {0, 1} and rows["probability"].between(0.5, 1).all()
    assert f"{ROWS} rows scored in" in stdout
    # The single-file template reached the worker as a copy of its own.
    assert list((tmp_path / "worker-templates").glob("**/classifier.joblib"))


@pytest.mark.slow
@pytest.mark.soak  # a run killed part way, then run again
@pytest.mark.parametrize("task", ["builtin", "own"])
def test_embed_sentence_transformers_killed_part_way_resumes_with_every_row_once(task, tmp_path):
    rows, stdout = _killed_and_resumed(
        "embed_sentence_transformers.py", tmp_path / f"st-{task}", tmp_path,
        "--task", task, "--rows", str(ROWS),
    )  # fmt: skip
    assert rows["embedding"].map(len).eq(32).all()
    norms = rows["embedding"].map(lambda v: float(sum(x * x for x in v)) ** 0.5)
    if task == "builtin":  # embed() normalises, through the model's own encode
        assert norms.between(0.999, 1.001).all() and rows["tokens"].gt(2).all()
    else:
        assert (norms - rows["norm"]).abs().lt(1e-3).all()
    assert f"{ROWS} embeddings of dimension 32 in" in stdout
