"""Faults of FEVER's own that a hostile user finds: an over-long claim, a template too long
for the model, reproduced for real (worker processes with a memory limit). The batch layer's
faults (a unit that never returns, a row that kills its worker, a lost scheduler) are tested
with plain functions in tests/batch."""

from __future__ import annotations

import json
import resource
from pathlib import Path

import pytest

from dask_pcm.apps.fever.data import write_demo
from dask_pcm.apps.fever.run import run_fever
from dask_pcm.batch.segments import read_predictions
from dask_pcm.exceptions import PromptTooLongError
from tests.conftest import cluster_client

LONG = 200_000  # characters: ~100,000 tokens for the tiny model, whose context holds 512


def _peak_rss() -> int:
    """Bytes: the peak resident memory of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@pytest.fixture(scope="module")
def capped_cluster():
    """Two worker processes capped at 2 GiB each, as a user would run them."""
    with cluster_client(n_workers=2, processes=True, memory_limit="2GiB") as client:
        yield client


@pytest.fixture
def long_claims(tmp_path: Path) -> Path:
    """The 30 demo claims, then one of 200,000 characters on line 31."""
    path = write_demo(tmp_path / "claims.jsonl")
    record = {"id": 99, "label": "SUPPORTS", "claim": "The claim goes on " * (LONG // 18)}
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
    return path


def test_an_over_long_claim_is_an_error_of_its_row_not_a_crash_loop(
    capped_cluster, tiny_model_dir, long_claims, tmp_path
):
    """It used to grow both workers past their limit; the nannies restarted them over and
    over until the run died with a raw KilledWorker, its neighbours failing with it."""
    client = capped_cluster
    workers = sorted(client.scheduler_info()["workers"])
    output = tmp_path / "preds"
    options = dict(model=tiny_model_dir, cluster=client, num_templates=2, progress=False)

    # Default: refused before any unit is scored, naming the file and line.
    with pytest.raises(PromptTooLongError, match=rf"{long_claims}:31: claim 99") as caught:
        run_fever(long_claims, output=output, **options)
    assert "512 tokens" in str(caught.value) and "--errors skip" in str(caught.value)
    assert read_predictions(output).empty

    # errors="skip": the run completes; the long claim is a recorded error of its row.
    result = run_fever(long_claims, output=output, errors="skip", **options)
    rows = result.predictions
    assert len(rows) == 2 * 31
    assert not rows.duplicated(["template", "claim_id"]).any()  # every row once
    failed = rows[rows["error"].notna()]
    assert sorted(failed["claim_id"]) == [99, 99]
    assert failed["predicted"].isna().all()
    assert "exceed the model's context of 512 tokens" in failed["error"].iloc[0]
    assert rows[rows["claim_id"] != 99]["predicted"].notna().all()
    assert result.report["row_errors"] == 2
    assert any(f"{long_claims}:31: claim 99" in e for e in result.report["row_error_examples"])
    assert result.summary["errors"].tolist() == [1, 1]

    # Truncation only when asked for, and counted.
    cut = run_fever(long_claims, truncate=True, **options)
    assert cut.predictions["error"].isna().all()
    assert cut.report["truncated"] == 2
    long_rows = cut.predictions[cut.predictions["claim_id"] == 99]
    assert (long_rows["truncated_tokens"] > 80_000).all()

    # No worker died: the same two processes, each well under 2 GiB at its peak.
    assert sorted(client.scheduler_info()["workers"]) == workers
    peaks = client.run(_peak_rss)
    assert max(peaks.values()) < 2 * 2**30, peaks


def test_a_template_too_long_for_the_model_is_refused_before_any_work(
    capped_cluster, tiny_model_dir
):
    template = "Read this carefully. " * 400 + "Claim: {claim}\nAnswer:"
    with pytest.raises(PromptTooLongError, match=r"template 'custom-1' is \d+ tokens without"):
        run_fever(
            model=tiny_model_dir, templates=[template], cluster=capped_cluster, progress=False
        )
