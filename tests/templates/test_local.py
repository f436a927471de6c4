"""One local copy per host and template: made once, reused after verification, remade when
damaged, with leftovers of dead processes removed, read once by joiners that waited for it,
removed by its last user (dask_pcm.templates.local)."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import dask
import pytest

from dask_pcm.locks import file_lock
from dask_pcm.templates import local
from dask_pcm.templates.local import local_copy, use_copy
from dask_pcm.templates.manifest import MANIFEST_NAME, Manifest, TemplateWriter, build_manifest
from dask_pcm.templates.reader import SourceReader
from tests.conftest import run_in_threads

KIB = 1024


@pytest.fixture
def template(tiny_model_dir: Path, tmp_path: Path) -> tuple[Manifest, Path]:
    with dask.config.set({"pcm.cache-directory": str(tmp_path / "cache")}):
        return build_manifest(tiny_model_dir, 64 * KIB)


class _FromSource:
    """A ``make`` for local_copy: the template chunk by chunk from its source; counts calls."""

    def __init__(self, manifest: Manifest, root: Path) -> None:
        self.manifest, self.root, self.calls = manifest, root, 0

    def __call__(self, dest: Path) -> None:
        self.calls += 1
        writer = TemplateWriter(self.manifest, dest)
        for index in range(self.manifest.nchunks):
            writer.write(index, SourceReader().read(self.root, self.manifest, index))
        writer.finish()


def _same_files(manifest: Manifest, a: Path, b: Path) -> bool:
    return all((a / f.path).read_bytes() == (b / f.path).read_bytes() for f in manifest.files)


def test_made_once_then_reused(template, tmp_path):
    manifest, root = template
    make = _FromSource(manifest, root)
    first = local_copy(tmp_path / "templates", manifest, make)
    again = local_copy(tmp_path / "templates", manifest, make)
    assert first == again == tmp_path / "templates" / manifest.digest[:16]
    assert make.calls == 1
    assert _same_files(manifest, first, root)


def test_a_damaged_or_incomplete_copy_is_made_again(template, tmp_path):
    manifest, root = template
    make = _FromSource(manifest, root)
    dest = local_copy(tmp_path / "templates", manifest, make)
    with open(dest / "model.safetensors", "r+b") as f:  # a bad disk, a partial write
        f.seek(100)
        f.write(b"\0" * 100)
    assert local_copy(tmp_path / "templates", manifest, make) == dest
    assert make.calls == 2
    (dest / "tokenizer.json").unlink()  # a scratch cleaner removed it
    local_copy(tmp_path / "templates", manifest, make)
    assert make.calls == 3
    assert _same_files(manifest, dest, root)
    # Trusted (this process made it): not read again, so not remade.
    (dest / "tokenizer.json").unlink()
    local_copy(tmp_path / "templates", manifest, make, trusted=True)
    assert make.calls == 3


def test_staging_folders_of_dead_processes_are_removed(template, tmp_path):
    manifest, root = template
    make = _FromSource(manifest, root)
    dest = local_copy(tmp_path / "templates", manifest, make)
    stale = dest.with_name(f".{dest.name}.99999.partial")  # a writer killed mid-copy
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    (dest / MANIFEST_NAME).unlink()  # and no complete copy
    shutil.rmtree(dest)
    local_copy(tmp_path / "templates", manifest, make)
    assert not stale.exists()
    assert _same_files(manifest, dest, root)


def test_two_threads_at_once_make_one_intact_copy(template, tmp_path):
    manifest, root = template
    make = _FromSource(manifest, root)
    results: list[Path] = []

    def copy() -> None:
        results.append(local_copy(tmp_path / "templates", manifest, make))

    assert run_in_threads(copy, 2) == []
    assert make.calls == 1
    assert results[0] == results[1]
    assert _same_files(manifest, results[0], root)
    # one copy, no leftovers: the folder, its lock file and its stamp
    names = sorted(p.name for p in (tmp_path / "templates").iterdir())
    name = results[0].name
    assert names == sorted([name, f".{name}.lock", f".{name}.verified"])


def _joining_at_once(directory: Path, manifest: Manifest, make, count: int, monkeypatch) -> list:
    """``count`` threads that use_copy at once: the copy's lock held until every one has
    looked at the copy's stamp (as workers that arrive while another holds the lock), so
    that none arrives after another is done (on a loaded machine, a thread may start late)."""
    looked = threading.Semaphore(0)
    read = local._read

    def counted(stamp):
        value = read(stamp)
        looked.release()
        return value

    monkeypatch.setattr(local, "_read", counted)
    directory.mkdir(parents=True, exist_ok=True)
    uses: list = []
    errors: list = []

    def join() -> None:
        try:
            uses.append(use_copy(directory, manifest, make))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=join) for _ in range(count)]
    with file_lock(directory / f".{manifest.digest[:16]}.lock"):
        for thread in threads:
            thread.start()
        for _ in threads:
            assert looked.acquire(timeout=30)
    for thread in threads:
        thread.join()
    monkeypatch.setattr(local, "_read", read)
    assert errors == []
    return uses


def test_joiners_that_wait_for_a_copy_read_it_once(template, tmp_path, monkeypatch):
    """Workers of a host joining at once: one makes the copy (or checks the one it found),
    the others waited for the lock meanwhile and trust it; a later joiner reads it again."""
    manifest, root = template
    make = _FromSource(manifest, root)
    checks: list[Path] = []

    def counted(dest, manifest):
        checks.append(dest)
        return verify(dest, manifest)

    verify = local.verify_copy
    monkeypatch.setattr(local, "verify_copy", counted)
    uses = _joining_at_once(tmp_path / "t", manifest, make, 3, monkeypatch)
    assert (make.calls, checks) == (1, [])  # made once, read by nobody again
    assert len({u.dest for u in uses}) == 1
    uses += _joining_at_once(tmp_path / "t", manifest, make, 3, monkeypatch)
    assert (make.calls, len(checks)) == (1, 1)  # found complete: checked once, by one of three
    for use in uses:
        use.release()


def test_the_last_user_of_a_copy_removes_it(template, tmp_path):
    manifest, root = template
    make = _FromSource(manifest, root)
    first = use_copy(tmp_path / "t", manifest, make)
    second = use_copy(tmp_path / "t", manifest, make)
    assert first.release() is False  # the other worker still builds from it
    assert first.release() is False  # idempotent
    assert (second.dest / MANIFEST_NAME).is_file()
    assert second.release() is True
    assert not second.dest.exists()
    again = use_copy(tmp_path / "t", manifest, make)  # a later worker makes it again
    assert make.calls == 2 and _same_files(manifest, again.dest, root)
    again.release()


def test_a_copy_made_by_the_client_is_trusted_by_workers_told_its_stamp(
    template, tmp_path, monkeypatch
):
    """A run's client makes the host copy while its local cluster starts (HostCopy); its
    workers, told the copy's stamp, use it without reading every byte again. A worker not
    told it, or a copy whose stamp changed, is read again as before."""
    manifest, root = template
    scratch = tmp_path / "scratch"
    directory = scratch / "pcm-templates"
    made = local.HostCopy(manifest, root, directory, scratch)
    assert local.host_stamp(manifest.digest) == made.token
    made.make()
    assert made.use is not None and _same_files(manifest, made.use.dest, root)
    verified: list[Path] = []
    verify = local.verify_copy

    def counted(dest, manifest):
        verified.append(dest)
        return verify(dest, manifest)

    monkeypatch.setattr(local, "verify_copy", counted)
    never = _FromSource(manifest, root)
    dest, use = local.host_copy(directory, scratch, manifest, never, known=made.token)
    assert (dest, verified, never.calls) == (made.use.dest, [], 0)
    _, other = local.host_copy(directory, scratch, manifest, never)  # not told: read again
    assert verified == [dest] and never.calls == 0
    # That check wrote a stamp of its own: the client's no longer vouches for the copy.
    _, third = local.host_copy(directory, scratch, manifest, never, known=made.token)
    assert verified == [dest, dest]
    made.release()
    assert local.host_stamp(manifest.digest) is None
    for later in (other, third):
        assert later is not None and later.release() is False
    assert dest.is_dir()  # the first worker's use holds it
    assert use is not None and use.release() is True and not dest.exists()


def test_a_client_copy_that_fails_leaves_the_copy_to_the_workers(template, tmp_path):
    manifest, _ = template
    (tmp_path / "gone").mkdir()
    made = local.HostCopy(manifest, tmp_path / "gone", tmp_path / "s" / "t", tmp_path / "s")
    made.make()  # logs, does not raise
    assert made.use is None and local.host_stamp(manifest.digest) is None
    assert not any((tmp_path / "s" / "t").glob("*.partial"))
    made.release()


def test_a_client_copy_cancelled_midway_leaves_nothing_behind(template, tmp_path):
    """A run that ends while its client still copies (Ctrl-C during start-up) must not
    wait for the whole template, nor leave a half copy."""
    manifest, root = template
    made = local.HostCopy(manifest, root, tmp_path / "s" / "t", tmp_path / "s")
    made.cancel()
    made.make()
    assert made.use is None and local.host_stamp(manifest.digest) is None
    assert list((tmp_path / "s" / "t").iterdir()) == [
        tmp_path / "s" / "t" / f".{manifest.digest[:16]}.lock"
    ]
    made.release()
