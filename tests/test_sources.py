"""Resolving model sources and staging template copies (dask_pcm.sources)."""

from __future__ import annotations

import re
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest
from huggingface_hub import constants

import dask_pcm.embedded
from dask_pcm.exceptions import ModelSourceError
from dask_pcm.sources import (
    EMBEDDED,
    ResolvedSource,
    StagedTemplate,
    resolve_source,
    stage_template,
    template_files,
)

MISSING_REPO = "dask-pcm-tests/no-such-model-4f7c"


@pytest.fixture
def online(monkeypatch):
    """Hub access allowed, whatever HF_HUB_OFFLINE said when huggingface_hub was imported."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


def _model_copy(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def _same_files(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir() if not p.name.startswith("."))
    return names == sorted(p.name for p in b.iterdir() if not p.name.startswith(".")) and all(
        (a / n).read_bytes() == (b / n).read_bytes() for n in names
    )


# -- resolve_source --------------------------------------------------------------------------


@pytest.mark.parametrize("source", [None, EMBEDDED])
def test_embedded_resolves_to_the_converted_directory(source, monkeypatch, tmp_path):
    # The real conversion is covered by the slow test in test_llm.py; here only the dispatch.
    monkeypatch.setattr(dask_pcm.embedded, "embedded_model_dir", lambda: tmp_path)
    assert resolve_source(source) == ResolvedSource("directory", tmp_path, EMBEDDED)


def test_directory_with_config(tiny_model_dir):
    resolved = resolve_source(str(tiny_model_dir))
    assert resolved == ResolvedSource("directory", tiny_model_dir.resolve(), str(tiny_model_dir))
    assert resolve_source(tiny_model_dir).path == tiny_model_dir.resolve()  # PathLike too


def test_directory_without_config_json(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"x")
    with pytest.raises(ModelSourceError, match=r"config\.json") as info:
        resolve_source(tmp_path)
    assert str(tmp_path) in str(info.value)


def test_pickle_only_directory_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(ModelSourceError, match="pickle") as info:
        resolve_source(tmp_path)
    message = str(info.value)
    assert str(tmp_path) in message
    assert "save_pretrained(NEW_DIR)" in message


def test_directory_with_safetensors_and_pickle_is_accepted_without_the_pickle(
    tiny_model_dir, tmp_path
):
    model = _model_copy(tiny_model_dir, tmp_path / "m")
    (model / "pytorch_model.bin").write_bytes(b"pickle")
    names = [p.name for p in template_files(resolve_source(model))]
    assert "model.safetensors" in names
    assert "pytorch_model.bin" not in names


def test_gguf_file(tmp_path):
    gguf = tmp_path / "model.Q4_0.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_source(str(gguf)) == ResolvedSource("gguf", gguf.resolve(), str(gguf))


def test_file_of_another_format(tmp_path):
    weights = tmp_path / "model.bin"
    weights.write_bytes(b"pickle")
    with pytest.raises(ModelSourceError, match=r"\.gguf") as info:
        resolve_source(weights)
    assert str(weights) in str(info.value)


def test_missing_path(tmp_path):
    missing = tmp_path / "no" / "such-model"
    with pytest.raises(ModelSourceError, match="does not exist") as info:
        resolve_source(str(missing))
    assert f"'{missing}'" in str(info.value)


def test_hub_id_offline_mode_fails_at_once(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    with pytest.raises(ModelSourceError, match="HF_HUB_OFFLINE") as info:
        resolve_source(MISSING_REPO)
    assert time.perf_counter() - start < 5
    assert f"hf download {MISSING_REPO} --local-dir DIR" in str(info.value)


def test_hub_id_without_network_fails_fast(online):
    # This machine reaches no model hub: the attempt must give up in seconds, not minutes.
    start = time.perf_counter()
    with pytest.raises(ModelSourceError) as info:
        resolve_source(MISSING_REPO)
    elapsed = time.perf_counter() - start
    assert elapsed < 10, f"took {elapsed:.1f} s"
    message = str(info.value)
    assert MISSING_REPO in message
    assert "--local-dir DIR` and pass that directory as the model" in message


def test_hub_id_with_an_unreachable_proxy_says_so(online, monkeypatch):
    # Port 9 (discard) is closed on localhost: the connection is refused at once.
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")
    with pytest.raises(ModelSourceError, match="could not be reached") as info:
        resolve_source(MISSING_REPO)
    assert "through proxy http://127.0.0.1:9" in str(info.value)


def test_hub_that_never_answers_fails_in_seconds(online, monkeypatch):
    # A listening socket that never accepts: connections open, requests get no answer,
    # like a black-holed route or a hung proxy. The hub client alone would wait for minutes.
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
        start = time.perf_counter()
        with pytest.raises(ModelSourceError, match="could not be reached") as info:
            resolve_source(MISSING_REPO)
        elapsed = time.perf_counter() - start
    assert elapsed < 6, f"took {elapsed:.1f} s"
    assert "127.0.0.1" in str(info.value)


def _fake_hub_cache(root: Path, repo_id: str, files: Path) -> Path:
    """Lay out ``files`` as the hub cache does after a download of ``repo_id``."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = root / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    shutil.copytree(files, snapshot)
    return snapshot


def test_hub_id_found_in_the_hub_cache(tiny_model_dir, tmp_path, monkeypatch):
    snapshot = _fake_hub_cache(tmp_path, "someone/tiny-llama", tiny_model_dir)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the cache alone must do
    resolved = resolve_source("someone/tiny-llama")
    assert resolved == ResolvedSource("hub", snapshot, "someone/tiny-llama")
    staged = stage_template("someone/tiny-llama", tmp_path / "staged")
    assert staged.path.name.startswith("someone_tiny-llama-")
    assert _same_files(staged.path, tiny_model_dir)


def test_hub_snapshot_without_safetensors_is_refused(tmp_path, monkeypatch):
    files = tmp_path / "files"
    files.mkdir()
    (files / "config.json").write_text("{}")
    _fake_hub_cache(tmp_path / "hub", "someone/pickled", files)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelSourceError, match=r"no \*\.safetensors") as info:
        resolve_source("someone/pickled")
    assert "someone/pickled" in str(info.value)


# -- template_files ----------------------------------------------------------------------------


def test_template_files_of_a_directory(tiny_model_dir, tmp_path):
    model = _model_copy(tiny_model_dir, tmp_path / "m")
    for name in ("vocab.txt", "merges.txt", "spiece.model", "qwen.tiktoken", "notes.jinja"):
        (model / name).write_text("x")
    for name in ("training_args.bin", "optimizer.pt", "rng.pth", "vocab.pkl", "README.md"):
        (model / name).write_text("x")
    (model / "model.Q8_0.gguf").write_text("x")  # the loader reads the safetensors weights
    (model / "sub").mkdir()
    (model / "sub" / "extra.safetensors").write_text("x")

    names = [p.name for p in template_files(resolve_source(model))]
    assert names == [
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "merges.txt",
        "model.safetensors",
        "notes.jinja",
        "qwen.tiktoken",
        "spiece.model",
        "tokenizer.json",
        "tokenizer_config.json",
        "vocab.txt",
    ]


def test_a_link_out_of_the_model_directory_is_refused(tiny_model_dir, tmp_path):
    """A template is copied to workers and served to peers: a link must not carry a file
    from elsewhere on the machine into it."""
    model = _model_copy(tiny_model_dir, tmp_path / "m")
    elsewhere = tmp_path / "private"
    elsewhere.mkdir()
    (elsewhere / "secrets.json").write_text('{"token": "x"}')
    (model / "tokenizer_config.json").unlink()
    (model / "tokenizer_config.json").symlink_to(elsewhere / "secrets.json")
    with pytest.raises(
        ModelSourceError, match=r"'tokenizer_config\.json' is a symbolic link to"
    ) as e:
        template_files(resolve_source(model))
    assert str(elsewhere / "secrets.json") in str(e.value) and str(model) in str(e.value)
    with pytest.raises(ModelSourceError, match="symbolic link"):
        stage_template(model, tmp_path / "staged")


def test_links_inside_the_model_directory_or_a_hub_cache_are_followed(tiny_model_dir, tmp_path):
    model = _model_copy(tiny_model_dir, tmp_path / "m")
    (model / "weights").mkdir()
    (model / "model.safetensors").rename(model / "weights" / "real.safetensors")
    (model / "model.safetensors").symlink_to(model / "weights" / "real.safetensors")
    assert "model.safetensors" in [p.name for p in template_files(resolve_source(model))]
    # A hub cache's layout (anywhere on disk): snapshots/<rev>/<file> -> ../../blobs/<hash>
    repo = tmp_path / "cache" / "models--someone--tiny"
    snapshot, blobs = repo / "snapshots" / "0123abcd", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for f in tiny_model_dir.iterdir():
        shutil.copyfile(f, blobs / f"hash-{f.name}")
        (snapshot / f.name).symlink_to(Path("../../blobs") / f"hash-{f.name}")
    files = template_files(resolve_source(snapshot))
    expected = template_files(resolve_source(tiny_model_dir))
    assert [p.name for p in files] == [p.name for p in expected]


def test_template_files_of_a_gguf_file(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert template_files(resolve_source(gguf)) == [gguf.resolve()]


# -- stage_template ------------------------------------------------------------------------------


def test_stage_copies_once_then_reuses(tiny_model_dir, tmp_path):
    root = tmp_path / "templates"
    first = stage_template(str(tiny_model_dir), root)
    expected = sum(p.stat().st_size for p in template_files(resolve_source(tiny_model_dir)))
    assert first.copied
    assert first.nbytes == expected
    assert first.path.parent == root
    assert first.path.name.startswith("tiny-llama-")
    assert _same_files(first.path, tiny_model_dir)

    second = stage_template(str(tiny_model_dir), root)
    assert second == StagedTemplate(first.path, expected, copied=False)


def test_stage_recopies_an_incomplete_or_outdated_copy(tiny_model_dir, tmp_path):
    model = _model_copy(tiny_model_dir, tmp_path / "m")
    root = tmp_path / "templates"
    staged = stage_template(model, root)

    (staged.path / "tokenizer.json").unlink()  # e.g. a scratch cleaner removed it
    again = stage_template(model, root)
    assert again.copied
    assert _same_files(again.path, model)

    (model / "config.json").write_text('{"changed": true}')  # the source changed size
    again = stage_template(model, root)
    assert again.copied
    assert (again.path / "config.json").read_text() == '{"changed": true}'


def test_stage_removes_temporary_folders_of_dead_copies(tiny_model_dir, tmp_path):
    root = tmp_path / "templates"
    staged = stage_template(tiny_model_dir, root)
    stale = root / f".{staged.path.name}.tmp-99999-deadbeef"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    (staged.path / ".pcm-manifest.json").unlink()
    assert stage_template(tiny_model_dir, root).copied
    assert not stale.exists()


def test_stage_a_gguf_file(tmp_path):
    gguf = tmp_path / "source" / "weights.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF" * 1000)
    staged = stage_template(gguf, tmp_path / "templates")
    assert staged.path.name == "weights.gguf"
    assert staged.path.read_bytes() == gguf.read_bytes()
    assert staged.nbytes == 4000
    assert resolve_source(staged.path).kind == "gguf"


def test_sources_with_the_same_name_do_not_collide(tiny_model_dir, tmp_path):
    a = _model_copy(tiny_model_dir, tmp_path / "a" / "model")
    b = _model_copy(tiny_model_dir, tmp_path / "b" / "model")
    (b / "config.json").write_text("{}")
    root = tmp_path / "templates"
    staged_a, staged_b = stage_template(a, root), stage_template(b, root)
    assert staged_a.path != staged_b.path
    assert _same_files(staged_a.path, a)
    assert _same_files(staged_b.path, b)


def test_folder_name_is_filesystem_safe(tiny_model_dir, tmp_path):
    odd = _model_copy(tiny_model_dir, tmp_path / "my model (v2) ümlaut")
    staged = stage_template(odd, tmp_path / "templates")
    assert re.fullmatch(r"[A-Za-z0-9._-]+", staged.path.name)
    assert _same_files(staged.path, odd)


def test_two_threads_staging_at_once_make_one_intact_copy(tiny_model_dir, tmp_path):
    root = tmp_path / "templates"
    barrier = threading.Barrier(2)
    results: list[StagedTemplate] = []
    errors: list[BaseException] = []

    def stage() -> None:
        barrier.wait()
        try:
            results.append(stage_template(tiny_model_dir, root))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=stage) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert not errors
    assert sorted(r.copied for r in results) == [False, True]
    assert results[0].path == results[1].path
    assert _same_files(results[0].path, tiny_model_dir)
    # one copy, no leftovers: the folder and its lock file
    assert sorted(p.name for p in root.iterdir()) == sorted(
        [results[0].path.name, f"{results[0].path.name}.lock"]
    )


def test_staging_a_missing_source_fails_with_its_path(tmp_path):
    missing = tmp_path / "gone"
    with pytest.raises(ModelSourceError, match="does not exist") as info:
        stage_template(missing, tmp_path / "templates")
    assert str(missing) in str(info.value)
