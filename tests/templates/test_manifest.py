"""Template manifests and chunks: hashing, reading, verifying and reassembling a template."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import dask
import pytest

from dask_pcm.exceptions import ModelSourceError
from dask_pcm.templates.manifest import (
    MANIFEST_NAME,
    ChunkError,
    Manifest,
    TemplateWriter,
    build_manifest,
    read_chunk,
    verify_chunk,
)

KIB = 1024


@pytest.fixture
def model_copy(tiny_model_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path):
    with dask.config.set({"pcm.cache-directory": str(tmp_path / "cache")}):
        yield


def test_manifest_lists_every_template_file_in_chunks(model_copy):
    (model_copy / "pytorch_model.bin").write_bytes(b"pickle")  # never part of a template
    manifest, root = build_manifest(model_copy, 64 * KIB)
    assert root == model_copy
    names = [f.path for f in manifest.files]
    assert "model.safetensors" in names and "config.json" in names
    assert "pytorch_model.bin" not in names
    for entry in manifest.files:
        assert entry.size == (model_copy / entry.path).stat().st_size
        assert len(entry.chunks) == -(-entry.size // (64 * KIB))
    assert manifest.total_bytes == sum(f.size for f in manifest.files)
    assert sum(r.length for r in manifest.chunks()) == manifest.total_bytes


def test_digest_is_stable_and_names_the_contents(model_copy):
    first, _ = build_manifest(model_copy, 64 * KIB)
    with dask.config.set({"pcm.cache-directory": str(model_copy.parent / "other-cache")}):
        again, _ = build_manifest(model_copy, 64 * KIB)  # hashed afresh
    assert again == first
    assert build_manifest(model_copy, 32 * KIB)[0].digest != first.digest
    weights = model_copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert build_manifest(model_copy, 64 * KIB)[0].digest != first.digest


def test_manifest_json_round_trip_and_tampering(model_copy):
    manifest, _ = build_manifest(model_copy, 64 * KIB)
    assert Manifest.from_json(manifest.to_json()) == manifest
    doc = json.loads(manifest.to_json())
    doc["files"][0]["size"] += 1
    with pytest.raises(ChunkError, match="does not match its contents"):
        Manifest.from_dict(doc)
    with pytest.raises(ChunkError, match="not a dask-pcm-template/1 manifest"):
        Manifest.from_dict({**doc, "format": "something else"})


def test_chunks_reassemble_into_the_same_files_in_any_order(model_copy, tmp_path):
    manifest, root = build_manifest(model_copy, 48 * KIB)
    writer = TemplateWriter(manifest, tmp_path / "copy")
    order = list(range(manifest.nchunks))
    random.Random(1).shuffle(order)
    for index in order:
        writer.write(index, read_chunk(root, manifest, index))
    dest = writer.finish()
    for entry in manifest.files:
        assert (dest / entry.path).read_bytes() == (root / entry.path).read_bytes()
    assert Manifest.from_json((dest / MANIFEST_NAME).read_text()) == manifest
    assert not list(tmp_path.glob(".copy.*"))  # the staging folder was moved into place


def test_a_corrupted_chunk_is_refused_and_can_be_written_again(model_copy, tmp_path):
    manifest, root = build_manifest(model_copy, 64 * KIB)
    big = max(manifest.chunks(), key=lambda r: r.length).index
    good = read_chunk(root, manifest, big)
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0x01
    writer = TemplateWriter(manifest, tmp_path / "copy")
    with pytest.raises(ChunkError, match=rf"chunk {big} \(.*\): SHA-256 .* does not match"):
        writer.write(big, bytes(bad))
    with pytest.raises(ChunkError, match="expected"):
        verify_chunk(manifest, big, good[:-1])
    with pytest.raises(ChunkError, match="still missing"):
        writer.finish()
    for index in range(manifest.nchunks):
        writer.write(index, read_chunk(root, manifest, index))
    writer.finish()
    with pytest.raises(ChunkError, match="out of range"):
        manifest.chunk(manifest.nchunks)


def test_a_gguf_template_is_the_file_itself(tiny_gguf_file):
    manifest, root = build_manifest(tiny_gguf_file, 256 * KIB)
    assert [f.path for f in manifest.files] == [tiny_gguf_file.name]
    assert root == tiny_gguf_file.parent


def test_a_missing_source_is_a_model_source_error(tmp_path):
    with pytest.raises(ModelSourceError):
        build_manifest(tmp_path / "nothing-here", 64 * KIB)


@pytest.mark.parametrize(
    "bad", ["../escaped", "/tmp/escaped", "sub/../../escaped", ".hidden", ".."]
)
def test_manifests_naming_files_outside_the_copy_are_refused(model_copy, tmp_path, bad):
    """A manifest travels to every worker, which writes the files it names: a traversal
    (``..``, an absolute path, a hidden name) is refused before any write."""
    manifest, _ = build_manifest(model_copy, 64 * KIB)
    data = manifest.to_dict()
    data["files"][0]["path"] = bad
    with pytest.raises(ChunkError, match="plain names"):
        Manifest.from_dict(data)
    # A Manifest built in code skips from_dict: the writer checks every path itself.
    first = manifest.files[0]
    crafted = Manifest(
        manifest.chunk_size,
        (type(first)(bad, first.size, first.chunks), *manifest.files[1:]),
        manifest.digest,
    )
    dest = tmp_path / "deep" / "copy"
    with pytest.raises(ChunkError):
        TemplateWriter(crafted, dest)
    assert not (tmp_path / "deep" / "escaped").exists()
    assert not Path("/tmp/escaped").exists()


def test_chunk_refs_carry_their_number_across_files(model_copy):
    """Chunks are numbered across files; a ref's index is that number, not its place in
    its file (verify_copy used it, and skipped every chunk past the first file's count)."""
    manifest, _ = build_manifest(model_copy, 16 * KIB)
    assert [r.index for r in manifest.chunks()] == list(range(manifest.nchunks))
    assert len({r.path for r in manifest.chunks()}) > 1
