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

from dask_pcm.exceptions import FeverFormatError, OutputFolderError
from dask_pcm.fever.run import run_fever
from dask_pcm.fever.segments import INDEX
from dask_pcm.fever.store import LOCK
from dask_pcm.fever.units import model_digest


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
    assert set(first.predictions["model_digest"]) == {model_digest(model)}
    monkeypatch.chdir(tmp_path)
    again = _run(client, "model", "preds.parquet")  # the same files, named another way
    assert again.report["units"] == {"total": 6, "computed": 0, "reused": 6}
    assert len(again.predictions) == 60


def test_changed_model_files_at_the_same_path_refuse_to_resume(client, model, tmp_path):
    """Rewriting the model behind the same path must not mix old and new predictions."""
    out = tmp_path / "preds.parquet"
    _run(client, model, out)
    config = model / "config.json"
    config.write_text(config.read_text() + "\n")  # other bytes, same path
    with pytest.raises(OutputFolderError, match=r"model_digest differs") as caught:
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
    with dask.config.set({"pcm.fever.segment-rows": 20}):  # 2 units of 10 rows per segment
        _run(client, model, out)
        part = sorted(out.glob("*.parquet"))[0]
        part.write_bytes(b"")  # a crash or a full disk
        with caplog.at_level(logging.WARNING, logger="dask_pcm"):
            again = _run(client, model, out)
    assert again.report["units"] == {"total": 6, "computed": 2, "reused": 4}
    assert any(part.name in r.getMessage() for r in caplog.records)
    assert [p.name for p in out.glob(f".{part.name}.unreadable-*")]  # kept, out of the way
    table = pd.read_parquet(out)
    assert len(table) == 60 and not table.duplicated(["claim_id", "template"]).any()


def test_a_segment_written_but_not_indexed_counts_as_done(client, model, tmp_path):
    """A run killed between renaming a segment into place and indexing it: the segment's
    footer says which units it holds; none is computed again, no row is doubled."""
    out = tmp_path / "preds.parquet"
    with dask.config.set({"pcm.fever.segment-rows": 20}):
        _run(client, model, out)
        index = out / INDEX
        lines = index.read_text().splitlines()
        index.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:15])  # half a last line
        again = _run(client, model, out)
    assert again.report["units"] == {"total": 6, "computed": 0, "reused": 6}
    assert len(pd.read_parquet(out)) == 60
    assert len(index.read_text().splitlines()) == 3  # rewritten whole, one line per segment


def test_a_missing_segment_is_computed_again(client, model, tmp_path, caplog):
    out = tmp_path / "preds.parquet"
    with dask.config.set({"pcm.fever.segment-rows": 20}):
        _run(client, model, out)
        sorted(out.glob("*.parquet"))[-1].unlink()
        with caplog.at_level(logging.WARNING, logger="dask_pcm"):
            again = _run(client, model, out)
    assert again.report["units"] == {"total": 6, "computed": 2, "reused": 4}
    assert any("is missing" in r.getMessage() for r in caplog.records)
    assert len(pd.read_parquet(out)) == 60


def test_units_go_into_a_bounded_number_of_files(client, model, tmp_path):
    """One file per unit was the old layout: 60 units wrote 60 files."""
    out = tmp_path / "preds.parquet"
    with dask.config.set({"pcm.fever.tasks-in-flight": 2}):
        result = _run(client, model, out, claims_per_task=1)
    assert result.report["units"]["total"] == 60
    assert result.report["files"] == 1 and len(list(out.glob("*.parquet"))) == 1
    assert result.report["tasks"] < 60  # units are packed into tasks
    assert len(pd.read_parquet(out)) == 60


def test_a_resume_with_nothing_left_starts_no_cluster(model, tmp_path, monkeypatch, client):
    import dask_pcm.fever.run as run_module

    out = tmp_path / "preds.parquet"
    first = _run(client, model, out)

    def no_cluster(*args, **kwargs):
        raise AssertionError("a cluster was started with nothing to compute")

    monkeypatch.setattr(run_module, "_client", no_cluster)
    again = run_fever(model=model, output=out, num_templates=2, claims_per_task=10, progress=False)
    assert again.report["units"] == {"total": 6, "computed": 0, "reused": 6}
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


_KILLED_WRITER = """
import os, signal, sys
import pyarrow as pa
from dask_pcm.fever.store import OutputStore
store = OutputStore(sys.argv[1], {"templates": {}}, segment_rows=1000, flush_interval=float(sys.argv[2]))
store.open()
for i in range(5):
    store.add(f"t--{i:05d}", pa.table({"claim_id": [2 * i, 2 * i + 1], "template": ["t", "t"]}))
os.kill(os.getpid(), signal.SIGKILL)  # no close, no flush: a killed run
"""


@pytest.mark.parametrize(("interval", "kept"), [(0.0, 5), (3600.0, 0)])
def test_a_killed_writer_loses_at_most_its_flush_interval(tmp_path, interval, kept):
    """Units added since the open segment was last written die with the process; with a
    flush interval of 0 every unit is on disk before the next one is added."""
    out = tmp_path / "preds.parquet"
    done = subprocess.run([sys.executable, "-c", _KILLED_WRITER, str(out), str(interval)])
    assert done.returncode == -9
    from dask_pcm.fever.store import OutputStore

    with OutputStore(out, {"templates": {}}) as store:
        assert store.done() == {f"t--{i:05d}" for i in range(kept)}
        assert store.files == (1 if kept else 0)
    if kept:
        assert len(pd.read_parquet(out)) == 2 * kept


def test_a_unit_is_never_added_twice(tmp_path):
    import pyarrow as pa

    from dask_pcm.fever.store import OutputStore

    with OutputStore(tmp_path / "out", {"templates": {}}, segment_rows=1) as store:
        store.add("t--00000", pa.table({"claim_id": [1], "template": ["t"]}))
    with (
        OutputStore(tmp_path / "out", {"templates": {}}) as store,
        pytest.raises(ValueError, match="already in"),
    ):
        store.add("t--00000", pa.table({"claim_id": [1], "template": ["t"]}))
    assert len(pd.read_parquet(tmp_path / "out")) == 1


def _indexed_units(out: Path) -> int:
    from dask_pcm.fever.segments import read_index

    segments, _ = read_index(out)
    return sum(len(s.units) for s in segments.values())


def test_a_run_killed_half_way_resumes_with_every_row_once(model, tmp_path):
    """SIGKILL to a whole CLI run (client, scheduler, workers) part way; the same command
    again computes exactly the units not on disk, and the folder holds every row once."""
    import json
    import signal

    from dask_pcm.fever import demo_claims

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
    assert report["units"] == {"total": 300, "computed": 300 - persisted, "reused": persisted}
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


def test_an_empty_folder_or_one_left_by_a_run_killed_before_its_manifest_is_used(tmp_path):
    """open() creates the lock file, then removes temporary files, then writes the
    manifest: a run killed in between leaves a folder that is still ours."""
    import pyarrow as pa

    from dask_pcm.fever.store import OutputStore

    empty = tmp_path / "empty"
    empty.mkdir()
    killed = tmp_path / "killed"
    killed.mkdir()
    (killed / LOCK).write_text("pid 4242 on somewhere since 12:00:00")
    stale = killed / "._dask_pcm_run.json.4242.0123abcd.tmp"
    stale.write_text('{"format": ')
    for out in (empty, killed):
        with OutputStore(out, {"templates": {}}) as store:
            store.add("t--00000", pa.table({"claim_id": [1], "template": ["t"]}))
        assert len(pd.read_parquet(out)) == 1
    assert not stale.exists()
    (empty / "notes.txt").unlink(missing_ok=True)
    other = tmp_path / "other"
    other.mkdir()
    (other / ".draft.tmp").write_text("the user's, not ours")  # hidden .tmp, not our name
    with pytest.raises(OutputFolderError, match=r"holds 1 file\(s\): \.draft\.tmp;"):
        OutputStore(other, {"templates": {}}).open()
    assert [p.name for p in other.iterdir()] == [".draft.tmp"]


def test_files_of_other_names_in_a_folder_of_ours_are_left_alone(tmp_path, caplog):
    """Spark's part names match part-*.parquet too: one without dask_pcm's footer used to
    be set aside as a damaged segment."""
    import pyarrow as pa

    from dask_pcm.fever.store import OutputStore, read_predictions

    out = tmp_path / "out"
    with OutputStore(out, {"templates": {}}, segment_rows=1) as store:
        store.add("t--00000", pa.table({"claim_id": [1], "template": ["t"]}))
    theirs = out / "part-00000-5a1c0a52-6d1e-4b4e-9a58-2f0c5e7d9a11-c000.snappy.parquet"
    pd.DataFrame({"id": [7]}).to_parquet(theirs)
    draft = out / ".draft.tmp"
    draft.write_text("the user's")
    kept = {p.name: p.read_bytes() for p in (theirs, draft)}
    with (
        caplog.at_level(logging.WARNING, logger="dask_pcm"),
        OutputStore(out, {"templates": {}}, segment_rows=1) as store,
    ):
        assert store.done() == {"t--00000"}
        store.add("t--00001", pa.table({"claim_id": [2], "template": ["t"]}))
    assert {p.name: p.read_bytes() for p in (theirs, draft)} == kept
    assert not list(out.glob("*unreadable*"))
    assert any(theirs.name in r.getMessage() for r in caplog.records)
    assert sorted(read_predictions(out)["claim_id"]) == [1, 2]  # only dask_pcm's segments


def test_flush_if_due_writes_a_unit_while_no_other_arrives(tmp_path):
    """Only add() flushed: with no further unit, finished rows stayed in memory."""
    import pyarrow as pa

    from dask_pcm.fever.store import OutputStore

    out = tmp_path / "out"
    with OutputStore(out, {"templates": {}}, flush_interval=0.5) as store:
        assert not store.flush_if_due()  # nothing to write
        store.add("t--00000", pa.table({"claim_id": [1, 2], "template": ["t", "t"]}))
        assert not store.flush_if_due()  # not yet due
        assert not list(out.glob("*.parquet"))
        time.sleep(0.6)
        assert store.flush_if_due()
        assert len(pd.read_parquet(out)) == 2  # a reader sees it while the run goes on
        assert not store.flush_if_due()  # nothing new since
    with OutputStore(out, {"templates": {}}) as store:
        assert store.done() == {"t--00000"}


# Adds units of incompressible rows, rewriting the open segment after each, until a write
# fails; prints the units added and the errors as JSON. argv: folder, RLIMIT_FSIZE or 0.
_FILLING_WRITER = """
import json, os, resource, signal, sys
import pyarrow as pa
from dask_pcm.exceptions import OutputFolderError
from dask_pcm.fever.store import OutputStore
out, limit = sys.argv[1], int(sys.argv[2])
if limit:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # then a write past the limit is EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
store = OutputStore(out, {"templates": {}}, segment_rows=10**6, flush_interval=0)
store.open()
added, errors = [], []
try:
    for i in range(100):
        ids = list(range(200 * i, 200 * (i + 1)))
        noise = [os.urandom(64).hex() for _ in ids]
        store.add(f"t--{i:05d}", pa.table({"claim_id": ids, "template": ["t"] * 200, "noise": noise}))
        added.append(f"t--{i:05d}")
except OutputFolderError as e:
    errors.append(str(e))
try:
    store.close()  # writes the open segment again: fails again
except OutputFolderError as e:
    errors.append(str(e))
print(json.dumps({"added": added, "errors": errors}))
"""


@pytest.fixture
def small_disk(tmp_path):
    """A real 256 KiB filesystem (tmpfs) mounted for the test, with 64 KiB of it taken by a
    file that can be deleted to free space."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    try:
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)],
            capture_output=True,
            text=True,
        )
    except FileNotFoundError:
        pytest.skip("no mount command")
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.strip()}")
    try:
        (disk / "filler").write_bytes(os.urandom(64 * 1024))
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)


def _fill(out: Path, limit: int = 0) -> tuple[list[str], list[str]]:
    import json

    done = subprocess.run(
        [sys.executable, "-c", _FILLING_WRITER, str(out), str(limit)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    return report["added"], report["errors"]


def _finish_and_check(out: Path, added: list[str]) -> None:
    """Rerun: the units written are done, the lost one is added again, every row once."""
    import pyarrow as pa

    from dask_pcm.fever.store import OutputStore

    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]
    with OutputStore(out, {"templates": {}}) as store:
        assert store.done() == set(added)
        i = len(added)
        store.add(f"t--{i:05d}", pa.table({"claim_id": [200 * i], "template": ["t"]}))
    table = pd.read_parquet(out)
    assert len(table) == 200 * len(added) + 1 and not table["claim_id"].duplicated().any()


def test_a_full_disk_names_the_folder_and_file_and_the_rerun_resumes(small_disk):
    """A real ENOSPC on a small tmpfs; the error used to be a bare '[Errno 28] No space left
    on device'."""
    out = small_disk / "preds.parquet"
    added, errors = _fill(out)
    assert added and len(errors) == 2
    for message in errors:
        assert message.startswith(f"output folder {out}: writing part-000000.parquet failed")
        assert "[Errno 28] No space left on device" in message
        assert message.endswith(
            "Free space, then run the same command again: finished units already written are kept"
        )
    (small_disk / "filler").unlink()
    _finish_and_check(out, added)


def test_a_file_size_limit_is_reported_like_a_full_disk(tmp_path):
    """RLIMIT_FSIZE: a kernel-enforced write failure (EFBIG) that needs no root."""
    out = tmp_path / "preds.parquet"
    added, errors = _fill(out, limit=60_000)
    assert added and errors
    assert f"output folder {out}: writing part-000000.parquet failed" in errors[0]
    assert "[Errno 27] File too large" in errors[0] and "run the same command again" in errors[0]
    _finish_and_check(out, added)
