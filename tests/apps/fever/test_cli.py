"""The ``dask-pcm fever`` command: a summary table, a JSON report, and clean errors."""

from __future__ import annotations

import json

from click.testing import CliRunner

from dask_pcm.apps.fever import write_demo
from dask_pcm.cli import main


def test_fever_prints_summary_and_writes_json(tiny_model_dir, tmp_path):
    data = write_demo(tmp_path / "claims.jsonl")
    report_path = tmp_path / "reports" / "today" / "run.json"  # folders created up front
    args = [
        "fever", "--data", str(data), "--model", str(tiny_model_dir), "--num-templates", "2",
        "--claims-per-task", "8", "--limit", "12", "--workers", "1", "--json", str(report_path),
        "--output", str(tmp_path / "preds.parquet"),
    ]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "accuracy" in result.output and "macro_f1" in result.output
    payload = json.loads(report_path.read_text())
    assert [set(row) >= {"template", "accuracy", "n"} for row in payload["summary"]] == [True] * 2
    assert all(row["n"] == 12 for row in payload["summary"])
    report = payload["report"]
    assert report["wall_seconds"] > 0
    (worker,) = report["workers"]
    assert set(worker) >= {"worker", "context", "loads", "load_seconds", "tasks"}
    assert worker["loads"] == 1 and worker["tasks"] == 4  # 2 templates x 2 batches


def test_malformed_data_is_one_clear_error_not_a_traceback(tmp_path):
    bad = tmp_path / "paper_dev.jsonl"
    bad.write_text(
        '{"id": 1, "label": "SUPPORTS", "claim": "Fine."}\n{"id": 2, "label": "MAYBE", "claim": "x"}\n'
    )
    result = CliRunner().invoke(main, ["fever", "--data", str(bad), "--workers", "1"])
    assert result.exit_code != 0
    assert f"{bad}:2:" in result.output and "MAYBE" in result.output
    assert "Traceback" not in result.output
    result = CliRunner().invoke(main, ["fever", "--templates", "no-such-template"])
    assert result.exit_code != 0 and "no-such-template" in result.output


def test_an_over_long_claim_is_refused_by_line_or_recorded_with_errors_skip(
    tiny_model_dir, tmp_path
):
    data = write_demo(tmp_path / "claims.jsonl")
    with open(data, "a") as f:
        f.write(json.dumps({"id": 99, "label": "REFUTES", "claim": "Long. " * 30_000}) + "\n")
    args = ["fever", "--data", str(data), "--model", str(tiny_model_dir)]
    args += ["--num-templates", "1", "--workers", "1"]
    refused = CliRunner().invoke(main, args)
    assert refused.exit_code == 1, refused.output
    assert f"{data}:31: claim 99" in refused.output and "--errors skip" in refused.output
    assert "Traceback" not in refused.output
    skipped = CliRunner().invoke(main, [*args, "--errors", "skip"])
    assert skipped.exit_code == 0, skipped.output
    assert "1 row(s) recorded as errors" in skipped.output
    assert f"{data}:31: claim 99 under template" in skipped.output
