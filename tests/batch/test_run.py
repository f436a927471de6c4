"""run_batch on its own (no FEVER): rows in, rows out keyed by id, resume, errors recorded
and retried, provenance refused by key, a task past its timeout, a row that kills its
worker. Each fault is reproduced for real (an exception, a task that never returns, a worker
process that exits)."""

from __future__ import annotations

import os
import threading
import time

import pytest
from distributed.diagnostics.plugin import WorkerPlugin

import dask_pcm
from dask_pcm.batch.segments import read_predictions
from dask_pcm.exceptions import OutputFolderError, UnitError
from tests.conftest import cluster_client


def _lengths(rows, suffix="", fail_on=None):
    """Tokens of each row's text by the resident model's tokenizer (a context task)."""
    lm = dask_pcm.get_context("llm")
    out = []
    for row in rows:
        if row["text"] == fail_on:
            raise ValueError(f"cannot take {row['text']!r}")
        with lm.lock:
            tokens = len(lm.tokenizer(row["text"] + suffix)["input_ids"])
        out.append({"tokens": tokens})
    return out


ROWS = [
    {"id": i, "text": f"row number {i}", "kind": "even" if i % 2 == 0 else "odd"} for i in range(40)
]


@pytest.fixture
def llm(tiny_model_dir):
    return dask_pcm.causal_lm(tiny_model_dir, name="llm")


def test_rows_in_rows_out_keyed_by_id_with_groups_and_carried_columns(inproc_cluster, llm):
    _, client = inproc_cluster
    result = dask_pcm.run_batch(
        _lengths,
        ROWS,
        contexts=llm,
        cluster=client,
        rows_per_unit=7,
        groups={"plain": {"suffix": ""}, "shout": {"suffix": "!!!"}},
        group_column="variant",
        carry=["kind"],
        progress=False,
    )
    rows = result.to_pandas()
    assert len(rows) == 2 * 40 and not rows.duplicated(["variant", "id"]).any()
    assert set(rows.columns) >= {"id", "variant", "kind", "tokens"}
    plain = rows[rows["variant"] == "plain"].set_index("id")
    shout = rows[rows["variant"] == "shout"].set_index("id")
    assert (shout["tokens"] > plain["tokens"].reindex(shout.index)).all()
    assert list(plain["kind"]) == ["even" if i % 2 == 0 else "odd" for i in plain.index]
    assert result.report["units"] == {
        "total": 12,
        "computed": 12,
        "reused": 0,
        "failed": 0,
        "unfinished": 0,
    }


# One worker ready, the other still loading: the first build returns at once, the later
# ones wait for the gate (module state, shared by the in-process workers of one test).
_LOADS = {"calls": 0}
_LOADS_LOCK = threading.Lock()
_GATE = threading.Event()


def _second_load_waits(location: None) -> str:
    with _LOADS_LOCK:
        _LOADS["calls"] += 1
        first = _LOADS["calls"] == 1
    if not first:
        _GATE.wait(60)
    return "model"


def _uses_gated(rows):
    assert dask_pcm.get_context("gated") == "model"
    return [{"n": len(r["text"])} for r in rows]


def test_a_run_starts_on_the_first_ready_worker(inproc_cluster):
    """Units used to wait until every worker was ready: a slow second load held the first
    unit back (seconds on a fresh cluster, two model loads in a row before the load slot
    let CPU loads overlap)."""
    _, client = inproc_cluster
    try:
        result = dask_pcm.run_batch(
            _uses_gated, ROWS, contexts=dask_pcm.Context("gated", _second_load_waits), cluster=client,
            rows_per_unit=4, progress=False,
        )  # fmt: skip
        states = dask_pcm.status(client, ["gated"]).set_index("worker")["state"]
        assert sorted(states) == ["loading", "ready"]  # the other was loading all along
        assert result.report["units"]["computed"] == 10
        assert len(result.to_pandas()) == len(ROWS)
        tasks = {w["worker"]: w["tasks"] for w in result.report["workers"]}
        assert tasks[states[states == "loading"].index[0]] == 0
    finally:
        _GATE.set()
    dask_pcm.unregister(client, "gated")


def test_a_failing_unit_is_recorded_the_run_goes_on_and_a_rerun_retries_only_it(
    inproc_cluster, llm, tmp_path
):
    _, client = inproc_cluster
    out = tmp_path / "out"
    options = dict(contexts=llm, cluster=client, rows_per_unit=5, output=out, progress=False)
    with pytest.raises(UnitError, match=r"unit unit-00002 failed .*ValueError: cannot take"):
        dask_pcm.run_batch(_lengths, ROWS, fail_on="row number 12", **options)

    first = dask_pcm.run_batch(_lengths, ROWS, fail_on="row number 12", on_error="skip", **options)
    assert first.report["units"]["failed"] == 1
    (error,) = first.errors.to_dict("records")
    assert error["unit"] == "unit-00002" and error["type"] == "ValueError"
    assert "cannot take 'row number 12'" in error["message"]
    assert "Traceback" in error["traceback"] and error["worker"].startswith("inproc://")
    assert error["attempt"] == 1
    assert sorted(read_predictions(out)["id"]) == [i for i in range(40) if not 10 <= i < 15]
    assert (out / "_dask_pcm_errors.jsonl").exists()

    again = dask_pcm.run_batch(_lengths, ROWS, fail_on="row number 12", on_error="skip", **options)
    assert again.report["units"]["computed"] == 1  # only the failed unit is tried again
    assert len(again.errors) == 1

    fixed = dict(options, provenance={"kwargs": {}})  # the same results, recorded as such
    with pytest.raises(OutputFolderError, match=r"kwargs 'fail_on' differs"):
        dask_pcm.run_batch(_lengths, ROWS, **options)  # another argument: refused by key
    # A folder keyed without the argument that changed resumes; the failed unit succeeds.
    out2 = tmp_path / "out2"
    fixed["output"] = out2
    dask_pcm.run_batch(_lengths, ROWS, fail_on="row number 12", on_error="skip", **fixed)
    done = dask_pcm.run_batch(_lengths, ROWS, on_error="skip", **fixed)
    assert done.report["units"] == {
        "total": 8,
        "computed": 1,
        "reused": 7,
        "failed": 0,
        "unfinished": 0,
    }
    assert done.errors.empty and not (out2 / "_dask_pcm_errors.jsonl").read_text().strip()
    rows = read_predictions(out2)
    assert sorted(rows["id"]) == list(range(40))  # every row once


def test_changed_input_is_refused_naming_it(inproc_cluster, llm, tmp_path):
    _, client = inproc_cluster
    options = dict(contexts=llm, cluster=client, output=tmp_path / "o", progress=False)
    dask_pcm.run_batch(_lengths, ROWS, **options)
    changed = [dict(r, text=r["text"].upper()) for r in ROWS]
    with pytest.raises(OutputFolderError, match=r"input differs"):
        dask_pcm.run_batch(_lengths, changed, **options)


def _sleepy(rows):
    """Rows of the unit holding id 3 never return (until the worker is restarted)."""
    if any(r["id"] == 3 for r in rows):
        time.sleep(3600)
    return [{"seen": True} for _ in rows]


@pytest.fixture(scope="module")
def process_cluster():
    with cluster_client(n_workers=2, processes=True) as client:
        yield client


def test_a_task_past_its_timeout_is_recorded_and_its_worker_restarted(process_cluster, llm):
    client = process_cluster
    start = time.monotonic()
    result = dask_pcm.run_batch(
        _sleepy,
        ROWS[:12],
        contexts=llm,
        cluster=client,
        rows_per_unit=2,
        timeout=5,
        on_error="skip",
        progress=False,
    )
    assert time.monotonic() - start < 90  # not an hour
    (error,) = result.errors.to_dict("records")
    assert error["unit"] == "unit-00001" and error["type"] == "TimeoutError"
    assert "still running after" in error["message"]
    assert sorted(result.to_pandas()["id"]) == [i for i in range(12) if i not in (2, 3)]
    client.wait_for_workers(2, timeout=60)  # the stuck worker came back


def _template_counts(rows):
    """Bytes of the "llm" context's template this worker copied from the source and from
    peers, and its copy's folder (its status record)."""
    from distributed import get_worker

    from dask_pcm.protocol import plugin_name

    record = get_worker().plugins[plugin_name("llm")].record
    copied = record.bytes_from_source + record.bytes_from_peers
    return [{"copied": copied, "location": record.location} for _ in rows]


def test_a_local_cluster_the_run_starts_finds_its_template_copied_meanwhile(
    tiny_model_dir, tmp_path
):
    """The first worker of a local run used to copy the template only once the cluster had
    started (about a second for the embedded model, before it could load it); the client
    makes the host's copy while the cluster starts, and the workers use it without reading
    it again. The copy goes when the run ends, with the cluster."""
    import json
    import shutil

    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    config["pcm_test"] = str(tmp_path)  # a template of its own: no other test's copy
    (model / "config.json").write_text(json.dumps(config))
    llm = dask_pcm.causal_lm(model, name="llm")
    result = dask_pcm.run_batch(
        _template_counts, ROWS[:8], contexts=llm, workers=2, rows_per_unit=2, progress=False
    )
    out = result.to_pandas()
    assert list(out["copied"].unique()) == [0]  # no worker copied a byte
    (location,) = out["location"].unique()
    assert "dask-scratch-space" in location and not os.path.exists(location)


def _crash_on_poison(rows, log):
    """A worker that meets the text "POISON" dies on the spot (as one killed by the kernel's
    memory killer would), noting it in the file ``log``."""
    if any(r["text"] == "POISON" for r in rows):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        os._exit(1)
    return [{"n": len(r["text"])} for r in rows]


@pytest.mark.soak  # 30-80 s each: a worker killed four times
@pytest.mark.parametrize("with_context", [True, False], ids=["context", "no-context"])
def test_a_row_that_kills_its_worker_costs_that_row_only(
    process_cluster, llm, tmp_path, with_context
):
    """It used to cost the whole run: KilledWorker after allowed-failures + 1 worker deaths
    per submission, three submissions, then a raw traceback; neighbours failed with it. A
    function that needs no context gets the same isolation (the scheduler plugin that
    gives up on a task at its first lost worker is installed without a context)."""
    log = tmp_path / "deaths.log"
    rows = [dict(r) for r in ROWS[:30]]
    rows[5]["text"] = "POISON"
    result = dask_pcm.run_batch(
        _crash_on_poison, rows, contexts=llm if with_context else (), cluster=process_cluster,
        rows_per_unit=4, progress=False, log=str(log),
    )  # fmt: skip
    out = result.to_pandas().sort_values("id")
    assert list(out["id"]) == list(range(30))  # every row, once
    failed = out[out["error"].notna()]
    assert list(failed["id"]) == [5]
    assert "its worker died each of the 2 times" in failed["error"].iloc[0]
    assert out[out["id"] != 5]["n"].notna().all()
    # Deaths: its unit, its row among the unit's pieces, then the row twice in quarantine
    # (alone on the cluster): four, not a restart loop.
    assert len(log.read_text().split()) == 4
    assert result.report["lost_rows"] == 1


class _DieOnScatter(WorkerPlugin):
    """A worker plugin: the first worker handed a wave's rows (a scatter of a ``WaveRows``
    key) exits on the spot, while the scheduler's scatter call to it is still open. The
    file ``marker`` makes it one death per test, whichever worker process meets it."""

    name = "die-on-scatter"

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def setup(self, worker) -> None:
        handler = worker.handlers["update_data"]
        marker = self.marker

        def update_data(data=None, **kwargs):
            if any(str(k).startswith("WaveRows") for k in data or ()):
                try:
                    fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                except FileExistsError:
                    pass
                else:
                    os.close(fd)
                    os._exit(1)
            return handler(data=data, **kwargs)

        worker.handlers["update_data"] = update_data


def _slow_lengths(rows):
    time.sleep(0.05)
    return [{"n": len(r["text"])} for r in rows]


def test_a_worker_lost_while_its_wave_is_scattered_costs_a_retry(process_cluster, llm, tmp_path):
    """The scheduler's scatter to a worker that died during it used to end the run with
    ClusterLostError ("Stream is closed") although the scheduler was alive: the SLURM and
    emulated-host soaks failed on it in CI."""
    client = process_cluster
    marker = tmp_path / "died"
    client.register_plugin(_DieOnScatter(str(marker)))
    result = dask_pcm.run_batch(
        _slow_lengths, ROWS, contexts=llm, cluster=client, rows_per_unit=2, progress=False
    )
    assert marker.exists()  # a worker did die in the scatter
    out = result.to_pandas().sort_values("id")
    assert list(out["id"]) == list(range(40))  # every row, once
    assert out["n"].notna().all()
