"""Templates that are any tree of files: listing, safety rules, manifests of nested paths."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import dask
import pytest

from dask_pcm.engine.llm import CausalLM
from dask_pcm.exceptions import ChunkError, ModelSourceError
from dask_pcm.templates.manifest import Manifest, TemplateWriter, build_manifest, read_chunk
from dask_pcm.templates.tree import TemplateFiles, list_template, path_problem, tree_files
from dask_pcm.testing.encoders import MeanPoolingEncoder, build_tiny_encoder

KIB = 1024


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_encoder(tmp_path_factory.mktemp("encoders") / "tiny-encoder")


@pytest.fixture
def encoder_copy(encoder_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(encoder_dir, tmp_path / "encoder"))


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path):
    with dask.config.set({"pcm.cache-directory": str(tmp_path / "cache")}):
        yield


def test_a_tree_lists_every_file_of_its_subfolders_but_hidden_ones(encoder_copy):
    (encoder_copy / ".git").mkdir()
    (encoder_copy / ".git" / "HEAD").write_text("ref")
    (encoder_copy / "1_Pooling" / ".cache.json").write_text("{}")
    (encoder_copy / "index.faiss").write_bytes(b"FAISS")  # no Hugging Face pattern: travels
    files = tree_files(encoder_copy)
    assert files.root == encoder_copy and files.entry == ""
    assert files.names == (
        "1_Pooling/config.json",
        "README.md",
        "config.json",
        "index.faiss",
        "model.safetensors",
        "modules.json",
        "tokenizer/tokenizer.json",
    )
    # The causal LM keeps its model selection: top-level files of the safe patterns only.
    assert "1_Pooling/config.json" not in CausalLM().list_files(encoder_copy).names
    assert list_template(str(encoder_copy), MeanPoolingEncoder()) == files


def test_a_single_file_is_a_template_and_the_loader_is_pointed_at_it(tmp_path):
    index = tmp_path / "vectors.index"
    index.write_bytes(b"x" * 5000)
    files = tree_files(index)
    assert files == TemplateFiles(tmp_path, ("vectors.index",), "vectors.index")
    manifest, root = build_manifest(files, 2 * KIB)
    assert root == tmp_path and manifest.entry == "vectors.index" and manifest.nchunks == 3
    assert Manifest.from_json(manifest.to_json()) == manifest


def test_a_hugging_face_folder_lists_the_same_as_a_tree_and_as_a_model(tiny_model_dir):
    """Digests of model folders do not depend on which listing made them (FEVER records
    one in its output folders)."""
    as_model, _ = build_manifest(tiny_model_dir, 64 * KIB)
    as_tree, _ = build_manifest(tree_files(tiny_model_dir), 64 * KIB)
    assert as_tree.digest == as_model.digest


def test_nested_paths_reassemble_in_any_order_byte_for_byte(encoder_copy, tmp_path):
    manifest, root = build_manifest(tree_files(encoder_copy), 4 * KIB)
    assert manifest.nchunks > len(manifest.files)
    writer = TemplateWriter(Manifest.from_json(manifest.to_json()), tmp_path / "copy")
    order = list(range(manifest.nchunks))
    random.Random(3).shuffle(order)
    for index in order:
        writer.write(index, read_chunk(root, manifest, index))
    dest = writer.finish()
    for entry in manifest.files:
        assert (dest / entry.path).read_bytes() == (encoder_copy / entry.path).read_bytes()
    assert (dest / "1_Pooling" / "config.json").is_file()


def test_a_digest_covers_relative_paths(encoder_copy):
    before, _ = build_manifest(tree_files(encoder_copy), 64 * KIB)
    (encoder_copy / "tokenizer").rename(encoder_copy / "tokenizer2")
    after, _ = build_manifest(tree_files(encoder_copy), 64 * KIB)
    assert [f.chunks for f in after.files] == [f.chunks for f in before.files]
    assert after.digest != before.digest


def test_a_link_out_of_the_tree_is_refused_naming_it(encoder_copy, tmp_path):
    """A template is copied to workers and served to peers: a link in a subfolder must not
    carry a file from elsewhere on the machine into it."""
    private = tmp_path / "private"
    private.mkdir()
    (private / "secrets.json").write_text('{"token": "x"}')
    (encoder_copy / "1_Pooling" / "config.json").unlink()
    (encoder_copy / "1_Pooling" / "config.json").symlink_to(private / "secrets.json")
    with pytest.raises(ModelSourceError, match=r"'1_Pooling/config\.json' is a symbolic link") as e:
        tree_files(encoder_copy)
    assert str(private / "secrets.json") in str(e.value) and str(encoder_copy) in str(e.value)


def test_a_folder_link_out_of_the_tree_is_refused_naming_it(encoder_copy, tmp_path):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "id_rsa").write_text("key")
    (encoder_copy / "extra").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    with pytest.raises(ModelSourceError, match=r"'extra' is a symbolic link to"):
        tree_files(encoder_copy)


def test_links_inside_the_tree_are_followed(encoder_copy):
    (encoder_copy / "weights").mkdir()
    (encoder_copy / "model.safetensors").rename(encoder_copy / "weights" / "real.safetensors")
    (encoder_copy / "model.safetensors").symlink_to(encoder_copy / "weights" / "real.safetensors")
    (encoder_copy / "loop").symlink_to(encoder_copy, target_is_directory=True)  # no endless walk
    names = tree_files(encoder_copy).names
    assert "model.safetensors" in names and "weights/real.safetensors" in names


@pytest.mark.parametrize(
    "bad",
    ["1_Pooling/../../escaped", "../escaped", "/tmp/escaped", "a//b", "./a", "sub/.hidden", "a\\b"],
)
def test_a_manifest_path_with_dotdot_or_worse_is_refused_naming_it(encoder_copy, tmp_path, bad):
    assert path_problem(bad) is not None
    manifest, _ = build_manifest(tree_files(encoder_copy), 64 * KIB)
    data = manifest.to_dict()
    data["files"][0]["path"] = bad
    with pytest.raises(ChunkError, match="relative paths of plain names") as info:
        Manifest.from_dict(data)
    assert repr(bad) in str(info.value)
    first = manifest.files[0]
    crafted = Manifest(
        manifest.chunk_size,
        (type(first)(bad, first.size, first.chunks), *manifest.files[1:]),
        manifest.digest,
    )
    with pytest.raises(ChunkError, match="plain names"):
        TemplateWriter(crafted, tmp_path / "deep" / "copy")
    assert not (tmp_path / "escaped").exists() and not (tmp_path / "deep" / "escaped").exists()


def test_a_manifest_listing_a_file_as_a_folder_is_refused(encoder_copy):
    manifest, _ = build_manifest(tree_files(encoder_copy), 64 * KIB)
    data = manifest.to_dict()
    data["files"][1]["path"] = "config.json/inner"  # beside a file config.json
    with pytest.raises(ChunkError, match=r"'config\.json' both as a file and as a folder"):
        Manifest.from_dict(data)


def test_a_missing_or_empty_template_says_so(tmp_path):
    with pytest.raises(ModelSourceError, match="does not exist") as info:
        tree_files(tmp_path / "nothing")
    assert str(tmp_path / "nothing") in str(info.value)
    (tmp_path / "empty" / ".hidden").mkdir(parents=True)
    with pytest.raises(ModelSourceError, match=r"holds no files.*template=None"):
        tree_files(tmp_path / "empty")
