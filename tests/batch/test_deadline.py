"""run_batch's ``deadline`` (a whole run's time, as OpenAI's completion window) and
``on_unit`` (an application's own account of the run, unit by unit)."""

from __future__ import annotations

import time

import dask_pcm


def _slow(rows, seconds=0.0):
    time.sleep(seconds)
    if any(r["id"] == 3 for r in rows):
        raise ValueError("row 3 is refused")
    return [{"double": 2 * r["id"]} for r in rows]


ROWS = [{"id": i} for i in range(24)]


def test_units_past_the_deadline_are_left_to_a_rerun_which_does_them(inproc_cluster, tmp_path):
    _, client = inproc_cluster
    seen = []
    out = tmp_path / "out"
    first = dask_pcm.run_batch(
        _slow, ROWS, cluster=client, rows_per_unit=2, output=out, on_error="skip",
        deadline=1.5, progress=False, seconds=0.4,
        on_unit=lambda name, table, error: seen.append((name, table, error)),
    )  # fmt: skip
    units = first.report["units"]
    assert first.report["expired"] is True
    assert 0 < units["computed"] - units["unfinished"] < units["total"]
    done = first.to_pandas()
    # Each unit written once, and each one written told to on_unit, failed or not.
    assert sorted(done["id"]) == sorted({int(i) for i in done["id"]})
    told = {name for name, table, error in seen if table is not None}
    failed = [error for name, table, error in seen if table is None]
    assert len(told) == len(done) // 2
    assert all(e["ids"] == [2, 3] for e in failed)
    # A rerun without a deadline answers the rest, and only the rest.
    again = dask_pcm.run_batch(
        _slow, ROWS, cluster=client, rows_per_unit=2, output=out, on_error="skip",
        progress=False, seconds=0.4,
    )  # fmt: skip
    assert again.report["expired"] is False and again.report["units"]["unfinished"] == 0
    rows = again.to_pandas()
    assert sorted(rows["id"]) == [i for i in range(24) if i not in (2, 3)]
    assert (rows["double"] == 2 * rows["id"]).all()


def test_no_deadline_means_every_unit_runs(inproc_cluster):
    _, client = inproc_cluster
    result = dask_pcm.run_batch(_slow, ROWS[4:], cluster=client, rows_per_unit=4, progress=False)
    assert result.report["expired"] is False
    assert result.report["units"]["unfinished"] == 0 and len(result.to_pandas()) == 20
