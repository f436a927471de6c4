"""The output folder's store on its own: killed writers, units never twice, folders that are
not its own, the flush timer, full disks. (No FEVER import: tests of the batch layer.)"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from dask_pcm.batch.store import LOCK
from dask_pcm.exceptions import OutputFolderError

_KILLED_WRITER = """
import os, signal, sys
import pyarrow as pa
from dask_pcm.batch.store import OutputStore
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
    from dask_pcm.batch.store import OutputStore

    with OutputStore(out, {"templates": {}}) as store:
        assert store.done() == {f"t--{i:05d}" for i in range(kept)}
        assert store.files == (1 if kept else 0)
    if kept:
        assert len(pd.read_parquet(out)) == 2 * kept


def test_a_unit_is_never_added_twice(tmp_path):
    import pyarrow as pa

    from dask_pcm.batch.store import OutputStore

    with OutputStore(tmp_path / "out", {"templates": {}}, segment_rows=1) as store:
        store.add("t--00000", pa.table({"claim_id": [1], "template": ["t"]}))
    with (
        OutputStore(tmp_path / "out", {"templates": {}}) as store,
        pytest.raises(ValueError, match="already in"),
    ):
        store.add("t--00000", pa.table({"claim_id": [1], "template": ["t"]}))
    assert len(pd.read_parquet(tmp_path / "out")) == 1


def _indexed_units(out: Path) -> int:
    from dask_pcm.batch.segments import read_index

    segments, _ = read_index(out)
    return sum(len(s.units) for s in segments.values())


def test_an_empty_folder_or_one_left_by_a_run_killed_before_its_manifest_is_used(tmp_path):
    """open() creates the lock file, then removes temporary files, then writes the
    manifest: a run killed in between leaves a folder that is still ours."""
    import pyarrow as pa

    from dask_pcm.batch.store import OutputStore

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

    from dask_pcm.batch.store import OutputStore, read_predictions

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

    from dask_pcm.batch.store import OutputStore

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
from dask_pcm.batch.store import LOCK
from dask_pcm.exceptions import OutputFolderError
from dask_pcm.batch.store import OutputStore
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

    from dask_pcm.batch.store import OutputStore

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


# Adds two units of two rows, a segment each (the first written and indexed whole), and is
# killed while it writes the second, at the step argv[2] names. argv: folder, step.
_KILLED_WHILE_FLUSHING = """
import json, os, signal, sys
import pyarrow as pa
from dask_pcm.batch.segments import INDEX
from dask_pcm.batch.store import OutputStore

out, step = sys.argv[1], sys.argv[2]
replace, append = os.replace, OutputStore._append_index

def kill():
    os.kill(os.getpid(), signal.SIGKILL)

def replaced(src, dst):  # the temporary file is whole and fsynced; the rename never comes
    if step == "before-rename" and os.path.basename(dst) == "part-000001.parquet":
        kill()
    replace(src, dst)

def indexed(self, entry):
    if entry["segment"] != "part-000001.parquet":
        return append(self, entry)
    if step == "mid-index-line":  # half of the line reached the disk
        line = json.dumps(entry) + "\\n"
        with open(os.path.join(out, INDEX), "a") as f:
            f.write(line[: len(line) // 2])
    kill()  # "before-index": the segment is in place; its index line never comes

os.replace = replaced  # what atomic_file renames with
OutputStore._append_index = indexed
s = OutputStore(out, {"kwargs": {}}, segment_rows=2, flush_interval=0.0)
s.open()
s.add("unit-00000", pa.table({"id": [0, 1]}))
s.add("unit-00001", pa.table({"id": [2, 3]}))
"""


@pytest.mark.parametrize(
    ("step", "done"),
    [
        ("before-rename", {"unit-00000"}),
        ("before-index", {"unit-00000", "unit-00001"}),
        ("mid-index-line", {"unit-00000", "unit-00001"}),
    ],
)
def test_a_writer_killed_at_any_step_of_a_flush_loses_nothing(tmp_path, step, done):
    """SIGKILL before the segment's rename: its temporary file is removed by the next run
    and its unit counts as not done. After the rename, before or half way through its index
    line: the segment's own footer lists its units, a resume counts them done and the index
    is rewritten whole; a unit added again is refused, so no row is written twice."""
    import json

    import pyarrow as pa

    from dask_pcm.batch.segments import INDEX, read_index
    from dask_pcm.batch.store import OutputStore

    out = tmp_path / "out"
    killed = subprocess.run([sys.executable, "-c", _KILLED_WHILE_FLUSHING, str(out), step])
    assert killed.returncode == -9
    left = [p.name for p in out.iterdir() if p.name.endswith(".tmp")]
    assert bool(left) == (step == "before-rename")  # what the kill left, if anything
    with OutputStore(out, {"kwargs": {}}, segment_rows=2) as store:
        assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]
        assert store.done() == done
        lines = (out / INDEX).read_text().splitlines()
        assert [json.loads(line)["segment"] for line in lines] == [
            f"part-{i:06d}.parquet" for i in range(len(done))
        ]  # one whole line per segment: the half line is gone
        with pytest.raises(ValueError, match="already in"):
            store.add("unit-00000", pa.table({"id": [0, 1]}))
        if "unit-00001" not in done:
            store.add("unit-00001", pa.table({"id": [2, 3]}))
        store.add("unit-00002", pa.table({"id": [4]}))
    assert sorted(pd.read_parquet(out)["id"]) == [0, 1, 2, 3, 4]
    assert {u for s in read_index(out)[0].values() for u in s.units} == {
        "unit-00000", "unit-00001", "unit-00002",
    }  # fmt: skip


def test_changed_provenance_is_refused_naming_the_key(tmp_path):
    from dask_pcm.batch.store import OutputStore

    with OutputStore(tmp_path / "o", {"kwargs": {"temperature": 0}, "groups": {"a": {"x": 1}}}):
        pass
    with (
        pytest.raises(
            OutputFolderError, match=r"kwargs 'temperature' differs \(folder: 0, now: 1\)"
        ),
        OutputStore(tmp_path / "o", {"kwargs": {"temperature": 1}, "groups": {"a": {"x": 1}}}),
    ):
        pass
    with (
        pytest.raises(OutputFolderError, match=r"group 'a' changed \(x\)"),
        OutputStore(tmp_path / "o", {"kwargs": {"temperature": 0}, "groups": {"a": {"x": 2}}}),
    ):
        pass
    # A new group joins the folder; the old one stays listed.
    with OutputStore(tmp_path / "o", {"kwargs": {"temperature": 0}, "groups": {"b": {"x": 3}}}):
        pass
    import json

    manifest = json.loads((tmp_path / "o" / "_dask_pcm_run.json").read_text())
    assert manifest["groups"] == {"a": {"x": 1}, "b": {"x": 3}}


def test_a_function_loader_is_recorded_by_name_not_by_its_address():
    """A function's repr names its memory address, which changes with every process: recorded
    as it was, no rerun would ever resume."""
    from dask_pcm.batch.provenance import loader_spec

    def load(location):
        return location

    class Loader:
        def __call__(self, location):
            return location

    name = "test_a_function_loader_is_recorded_by_name_not_by_its_address.<locals>.load"
    assert loader_spec(load)["options"] == f"{__name__}.{name}"
    assert "0x" not in str(loader_spec(load)) and "0x" not in str(loader_spec(Loader()))
