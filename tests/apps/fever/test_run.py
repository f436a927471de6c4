"""run_fever end to end on an in-process cluster with the tiny model: results, resume, reuse."""

from __future__ import annotations

import dask
import pandas as pd
import pytest

import dask_pcm
from dask_pcm import client as client_module
from dask_pcm.apps.fever import LABELS
from dask_pcm.apps.fever.run import CONTEXT, run_fever
from dask_pcm.batch.segments import read_footer


@pytest.fixture
def client(make_cluster):
    return make_cluster(n_workers=2)


def test_every_claim_and_template_scored_once_and_summarised(client, tiny_model_dir):
    result = run_fever(
        model=tiny_model_dir, cluster=client, num_templates=3, claims_per_task=8, progress=False
    )
    pred = result.predictions
    assert len(pred) == 30 * 3
    assert not pred.duplicated(["claim_id", "template"]).any()
    assert set(pred["predicted"]) <= set(LABELS)
    summary = result.summary
    assert list(summary.columns[:4]) == ["template", "accuracy", "n", "macro_f1"]
    assert list(summary["n"]) == [30, 30, 30]
    assert list(summary["accuracy"]) == sorted(summary["accuracy"], reverse=True)
    for row in summary.itertuples():
        group = pred[pred["template"] == row.template]
        assert row.accuracy == pytest.approx((group["predicted"] == group["label"]).mean())
    report = result.report
    assert report["units"] == {
        "total": 12,
        "computed": 12,
        "reused": 0,
        "failed": 0,
        "unfinished": 0,
    }
    assert sum(w["tasks"] for w in report["workers"]) == 12
    _loaded_once(report)
    # The context stays on a cluster the user passed in: a second run does not reload it.
    again = run_fever(model=tiny_model_dir, cluster=client, num_templates=1, progress=False)
    _loaded_once(again.report)
    assert dask_pcm.registered_contexts(client) == [CONTEXT]


def test_a_run_reads_context_status_from_the_scheduler_once(client, tiny_model_dir, monkeypatch):
    reads = []
    status = client_module.status

    def counted(*args, **kwargs):
        reads.append(args[1:])
        return status(*args, **kwargs)

    monkeypatch.setattr(client_module, "status", counted)
    result = run_fever(model=tiny_model_dir, cluster=client, num_templates=1, progress=False)
    assert reads == [([CONTEXT],)]  # the workers' report, at the end
    # register() answered with the contexts' rows: none was read to wait for them.
    _loaded_once(result.report)
    assert sum(w["tasks"] for w in result.report["workers"]) == result.report["tasks"]


def test_prefix_states_change_nothing_but_the_work_and_show_in_status(client, tiny_model_dir):
    options = {"model": tiny_model_dir, "cluster": client, "progress": False}
    options.update(templates=["few-shot", "chat-few-shot", "direct"], claims_per_task=5)
    whole = run_fever(prefix_cache=False, **options).predictions
    table = dask_pcm.status(client, [CONTEXT])
    assert set(table["prefix_cache_bytes"]) == {0}  # nothing kept without it
    kept = run_fever(prefix_cache=True, **options).predictions
    key = ["template", "claim_id"]
    whole, kept = (
        whole.sort_values(key, ignore_index=True),
        kept.sort_values(key, ignore_index=True),
    )
    assert kept["predicted"].tolist() == whole["predicted"].tolist()
    scores = [c for c in whole.columns if c.startswith("score_")]
    assert (kept[scores] - whole[scores]).abs().max().max() < 1e-4
    table = dask_pcm.status(client, [CONTEXT])
    assert (table["prefix_cache_bytes"] > 0).all()  # each worker keeps its templates' prefixes


def test_output_resumes_without_duplicates(client, tiny_model_dir, tmp_path):
    out = tmp_path / "preds.parquet"
    options = dict(
        model=tiny_model_dir, cluster=client, num_templates=2, claims_per_task=8, output=out
    )
    with dask.config.set({"pcm.batch.segment-rows": 16}):  # two units of 8 claims per file
        first = run_fever(progress=False, **options)
        parts = sorted(out.glob("*.parquet"))
        assert len(parts) in (3, 4)  # units of 8, 8, 8 and 6 claims, as they finish
        assert all(pd.read_parquet(p).shape[0] >= 16 for p in parts[:-1])
        lost = len(read_footer(parts[0]).units)
        parts[0].unlink()  # as if the run had been killed before these units were written
        second = run_fever(progress=False, **options)
    assert second.report["units"] == {
        "total": 8,
        "computed": lost,
        "reused": 8 - lost,
        "failed": 0,
        "unfinished": 0,
    }
    assert sum(w["tasks"] for w in second.report["workers"]) == second.report["tasks"] <= lost
    assert len(second.predictions) == 60
    assert not second.predictions.duplicated(["claim_id", "template"]).any()
    key = ["template", "claim_id"]
    assert first.predictions.sort_values(key, ignore_index=True).equals(
        second.predictions.sort_values(key, ignore_index=True)
    )
    with pytest.raises(ValueError, match="rows_per_unit differs"):
        run_fever(
            model=tiny_model_dir, cluster=client, claims_per_task=4, output=out, progress=False
        )


def test_generate_method_and_bad_arguments(client, tiny_model_dir):
    result = run_fever(
        model=tiny_model_dir,
        cluster=client,
        num_templates=1,
        method="generate",
        limit=6,
        progress=False,
    )
    assert len(result.predictions) == 6
    assert "generated" in result.predictions.columns
    with pytest.warns(FutureWarning, match="claims_per_task"):  # the old name still works
        old = run_fever(
            model=tiny_model_dir, cluster=client, num_templates=1, limit=6, batch_size=3
        )
    assert old.report["units"]["total"] == 2
    with pytest.raises(ValueError, match="unknown scoring method"):
        run_fever(cluster=client, method="vote")
    with pytest.raises(ValueError, match="one of 'local', 'sge', 'htcondor', 'slurm'"):
        run_fever(model=tiny_model_dir, cluster="pbs", num_templates=1)


def _loaded_once(report):
    """Every worker that ran a task loaded the model once, and none loaded it twice. Work
    starts on the first ready worker: in a short run the other one may still be loading
    when the run ends (in-process workers load one at a time), and then it reports none."""
    workers = report["workers"]
    assert all(w["loads"] <= 1 for w in workers), workers
    assert all(w["loads"] == 1 for w in workers if w["tasks"]), workers
    assert any(w["tasks"] for w in workers), workers
