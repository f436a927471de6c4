"""Faults a hostile user finds: an over-long claim, a row that kills its worker, a unit that
never returns, a lost scheduler. Each test reproduces the fault for real (worker processes
with a memory limit, a worker process that exits, a scheduler process that is killed)."""

from __future__ import annotations

import json
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import dask
import pytest
from distributed import Client

import dask_pcm
from dask_pcm.apps.fever.data import write_demo
from dask_pcm.apps.fever.run import run_fever
from dask_pcm.apps.fever.units import score_unit
from dask_pcm.batch.segments import read_predictions
from dask_pcm.exceptions import ClusterLostError, PromptTooLongError

LONG = 200_000  # characters: ~100,000 tokens for the tiny model, whose context holds 512


def _peak_rss() -> int:
    """Bytes: the peak resident memory of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@pytest.fixture(scope="module")
def capped_cluster():
    """Two worker processes capped at 2 GiB each, as a user would run them."""
    with (
        dask_pcm.local_cluster(n_workers=2, memory_limit="2GiB", dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
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


RELEASE = threading.Event()


def _stuck_on_the_first_claim(template, claims, method, **options):
    """score_unit, but the unit holding claim 1 does not return until RELEASE is set."""
    if any(c.id == 1 for c in claims):
        RELEASE.wait(60)
    return score_unit(template, claims, method, **options)


def test_finished_units_are_written_on_time_while_a_unit_never_returns(
    inproc_cluster, tiny_model_dir, tmp_path, monkeypatch
):
    """Only a new finished unit used to flush: with one unit stuck, the others stayed in
    memory far past the flush interval, lost if the run was killed."""
    import dask_pcm.apps.fever.units as units_module

    _, client = inproc_cluster
    monkeypatch.setattr(units_module, "score_unit", _stuck_on_the_first_claim)
    RELEASE.clear()
    output = tmp_path / "preds"
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            outcome["result"] = run_fever(
                model=tiny_model_dir,
                cluster=client,
                num_templates=1,
                claims_per_task=3,
                output=output,
                progress=False,
            )
        except BaseException as exc:
            outcome["error"] = exc

    with dask.config.set({"pcm.batch.flush-interval": "0.5s", "pcm.batch.task-seconds": 0}):
        thread = threading.Thread(target=run)
        thread.start()
        try:
            deadline = time.monotonic() + 60
            written = 0
            while written < 27 and time.monotonic() < deadline:
                time.sleep(0.2)
                if (output / "_dask_pcm_index.jsonl").exists():
                    written = len(read_predictions(output))
            assert written == 27, f"{written} of the 27 finished rows on disk"
            assert thread.is_alive()  # the stuck unit still runs
        finally:
            RELEASE.set()
            thread.join(60)
    assert "error" not in outcome, outcome.get("error")
    assert len(read_predictions(output)) == 30


@pytest.fixture
def own_scheduler(tmp_path):
    """A scheduler process and one worker process, as ``dask scheduler`` / ``dask worker``
    start them: ``(address, scheduler process)``."""
    scheduler_file = tmp_path / "scheduler.json"
    dask_bin = Path(sys.executable).with_name("dask")
    argv = [dask_bin, "scheduler", "--port", "0", "--dashboard-address", ":0"]
    argv += ["--scheduler-file", str(scheduler_file)]
    scheduler = subprocess.Popen(argv, stderr=subprocess.DEVNULL)
    worker = None
    try:
        deadline = time.monotonic() + 60
        while not scheduler_file.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        address = json.loads(scheduler_file.read_text())["address"]
        worker = subprocess.Popen(
            [dask_bin, "worker", address, "--nthreads", "1", "--death-timeout", "5"],
            stderr=subprocess.DEVNULL,
        )
        yield address, scheduler
    finally:
        for process in (worker, scheduler):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait(30)


def _claims(tmp_path: Path) -> Path:
    data = tmp_path / "claims.jsonl"
    with open(data, "w") as f:
        for i in range(400):
            f.write(json.dumps({"id": i, "label": "SUPPORTS", "claim": f"Fact {i}."}) + "\n")
    return data


def _run(data: Path, model: Path, client: Client, output: Path) -> None:
    run_fever(data, model=model, cluster=client, claims_per_task=1, output=output, progress=False)


def test_a_killed_scheduler_is_named_not_a_cancelled_task(tiny_model_dir, tmp_path, own_scheduler):
    """The client used to say "task ... ended as 'cancelled', not finished"."""
    address, scheduler = own_scheduler
    data = _claims(tmp_path)
    with Client(address) as client:
        client.wait_for_workers(1, timeout=60)

        def kill_soon() -> None:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # until the model is ready: scoring
                rows = dask_pcm.status(client)
                if len(rows) and (rows["state"] == "ready").all():
                    break
                time.sleep(0.2)
            time.sleep(1)
            scheduler.send_signal(signal.SIGKILL)

        killer = threading.Thread(target=kill_soon)
        killer.start()
        start = time.monotonic()
        with pytest.raises(ClusterLostError, match=f"scheduler at {address}"):
            _run(data, tiny_model_dir, client, tmp_path / "preds")
        killer.join()
        assert time.monotonic() - start < 40


def test_a_scheduler_killed_during_a_call_to_it_is_named(tiny_model_dir, tmp_path, own_scheduler):
    """A scheduler that dies while the run waits on a call to it (here the check for overdue
    tasks, made every second when tasks have a timeout) used to end the run with the call's
    own ``OSError: Timed out trying to connect to ...`` (seen in CI, where the kill landed
    during such a call)."""
    address, scheduler = own_scheduler
    data = _claims(tmp_path)
    settings = {"distributed.comm.timeouts.connect": "3s", "pcm.batch.task-timeout": 600}
    with dask.config.set(settings), Client(address) as client:
        client.wait_for_workers(1, timeout=60)
        call = client.run_on_scheduler
        checks = []

        def killed_during(function, *args, **kwargs):
            if function.__name__ == "_executing":
                checks.append(1)
                if len(checks) == 3:  # seconds into the run, the model loaded
                    scheduler.send_signal(signal.SIGKILL)
                    scheduler.wait(30)
                    deadline = time.monotonic() + 30
                    while client.status == "running" and time.monotonic() < deadline:
                        time.sleep(0.05)  # the client has seen its connection close
            return call(function, *args, **kwargs)

        client.run_on_scheduler = killed_during  # type: ignore[method-assign]
        with pytest.raises(ClusterLostError, match=f"scheduler at {address}"):
            _run(data, tiny_model_dir, client, tmp_path / "preds")
        assert len(checks) == 3
