"""Resolving model sources and staging template copies (dask_pcm.templates.sources)."""

from __future__ import annotations

import shutil
import socket
import time
from pathlib import Path

import pytest
from huggingface_hub import constants

import dask_pcm.templates.embedded
from dask_pcm.exceptions import ModelSourceError
from dask_pcm.templates.manifest import build_manifest
from dask_pcm.templates.sources import (
    EMBEDDED,
    ResolvedSource,
    resolve_source,
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
    monkeypatch.setattr(dask_pcm.templates.embedded, "embedded_model_dir", lambda: tmp_path)
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
    manifest, root = build_manifest("someone/tiny-llama")  # what a worker copies
    assert root == snapshot
    assert manifest == build_manifest(tiny_model_dir)[0]  # the same files, the same digest


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
        build_manifest(model)  # so no worker copies it, nor serves it to peers


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
