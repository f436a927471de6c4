"""run_fever end to end on an in-process cluster with the tiny model: results, resume, reuse."""

from __future__ import annotations

from types import SimpleNamespace

import dask
import pandas as pd
import pytest
from distributed.scheduler import KilledWorker

import dask_pcm
from dask_pcm.fever import LABELS
from dask_pcm.fever.run import CONTEXT, run_fever
from dask_pcm.fever.segments import read_footer
from dask_pcm.fever.units import score_unit


@pytest.fixture
def client(inproc_cluster):
    return inproc_cluster[1]


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
    assert report["units"] == {"total": 12, "computed": 12, "reused": 0}
    assert sum(w["tasks"] for w in report["workers"]) == 12
    assert all(w["loads"] == 1 for w in report["workers"])
    # The context stays on a cluster the user passed in: a second run does not reload it.
    again = run_fever(model=tiny_model_dir, cluster=client, num_templates=1, progress=False)
    assert all(w["loads"] == 1 for w in again.report["workers"])
    assert dask_pcm.registered_contexts(client) == [CONTEXT]


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
    with dask.config.set({"pcm.fever.segment-rows": 16}):  # two units of 8 claims per file
        first = run_fever(progress=False, **options)
        parts = sorted(out.glob("*.parquet"))
        assert len(parts) in (3, 4)  # units of 8, 8, 8 and 6 claims, as they finish
        assert all(pd.read_parquet(p).shape[0] >= 16 for p in parts[:-1])
        lost = len(read_footer(parts[0]).units)
        parts[0].unlink()  # as if the run had been killed before these units were written
        second = run_fever(progress=False, **options)
    assert second.report["units"] == {"total": 8, "computed": lost, "reused": 8 - lost}
    assert sum(w["tasks"] for w in second.report["workers"]) == second.report["tasks"] <= lost
    assert len(second.predictions) == 60
    assert not second.predictions.duplicated(["claim_id", "template"]).any()
    key = ["template", "claim_id"]
    assert first.predictions.sort_values(key, ignore_index=True).equals(
        second.predictions.sort_values(key, ignore_index=True)
    )
    with pytest.raises(ValueError, match="claims_per_task differs"):
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
    with pytest.raises(ValueError, match="one of 'local', 'sge', 'htcondor'"):
        run_fever(model=tiny_model_dir, cluster="slurm", num_templates=1)


LOST: dict[tuple[str, int], int] = {}  # tries per piece, shared with the in-process workers
GONE = SimpleNamespace(address="tcp://10.0.0.1:1")  # the last worker that "died"


def _unlucky(template, claims, method, **options):
    """The first try of every piece (its first claim and size) loses its worker."""
    piece = (claims[0].id, len(claims))
    LOST[piece] = LOST.get(piece, 0) + 1
    if LOST[piece] == 1:
        raise KilledWorker(f"fever-{claims[0].id}", GONE, 3)
    return score_unit(template, claims, method, **options)  # the real one


def _poisoned(template, claims, method, **options):
    """Claim 5 loses its worker every time; the others are scored."""
    if any(c.id == 5 for c in claims):
        raise KilledWorker("fever-x", GONE, 3)
    return score_unit(template, claims, method, **options)


def test_units_lost_with_their_workers_are_split_and_run_again(client, tiny_model_dir, monkeypatch):
    """A task lost with its worker (KilledWorker) runs again in smaller pieces, down to
    single rows, which get a second try: bad luck costs no row. A row lost every time is
    recorded as an error row, and the run goes on (it used to end the run)."""
    import dask_pcm.fever.units as units_module

    LOST.clear()
    monkeypatch.setattr(units_module, "score_unit", _unlucky)
    result = run_fever(
        model=tiny_model_dir, cluster=client, num_templates=1, claims_per_task=10, progress=False
    )
    assert len(result.predictions) == 30
    assert result.predictions["error"].isna().all()
    assert result.report["row_errors"] == 0
    assert (1, 10) in LOST and (1, 3) in LOST and (1, 1) in LOST  # 10 -> 3 -> 1 rows

    monkeypatch.setattr(units_module, "score_unit", _poisoned)
    result = run_fever(
        model=tiny_model_dir, cluster=client, num_templates=1, claims_per_task=10, progress=False
    )
    predictions = result.predictions.sort_values("claim_id")
    assert list(predictions["claim_id"]) == list(range(1, 31))  # every row, once
    failed = predictions[predictions["error"].notna()]
    assert list(failed["claim_id"]) == [5]
    assert "its worker died each of the 2 times" in failed["error"].iloc[0]
    assert result.report["row_errors"] == 1
    assert result.summary["errors"].tolist() == [1]
    assert result.summary["n"].tolist() == [29]
