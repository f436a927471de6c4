"""Fixtures shared by the whole test suite."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from distributed import Client, LocalCluster

from dask_pcm.embedded import build_tiny_llama


@pytest.fixture
def inproc_cluster() -> Iterator[tuple[LocalCluster, Client]]:
    """A 2-worker, 1-thread-each LocalCluster in this process, and its client."""
    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=False, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
    ):
        yield cluster, client


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama model with its tokenizer (built offline in about a second)."""
    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_gguf_file(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model written as a float32 llama GGUF file, as llama.cpp's converter lays it out."""
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.F32.gguf"
    write_llama_gguf(tiny_model_dir, path)
    return path


# Hugging Face Llama tensor names (without "model.layers.N.") and their GGUF names.
_GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_GGUF_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def write_llama_gguf(model_dir: Path, out: Path) -> None:
    """Write a float32 GGUF file from a Llama safetensors directory with a byte-level BPE tokenizer."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    cfg = json.loads((model_dir / "config.json").read_text())
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    writer.add_rope_dimension_count(cfg["hidden_size"] // n_head)

    added = {t["content"]: t["id"] for t in tok["added_tokens"]}
    tokens: list[str] = [""] * cfg["vocab_size"]
    for token, index in {**tok["model"]["vocab"], **added}.items():
        tokens[index] = token
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in added else 1 for t in tokens])  # 3: control token
    writer.add_token_merges(
        [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    )
    writer.add_bos_token_id(added["<s>"])
    writer.add_eos_token_id(added["</s>"])
    writer.add_pad_token_id(added["<pad>"])
    writer.add_unk_token_id(added["<unk>"])
    writer.add_add_bos_token(True)
    writer.add_chat_template((model_dir / "chat_template.jinja").read_text())

    def permute(w: np.ndarray, heads: int) -> np.ndarray:
        # llama.cpp stores q/k rows interleaved for its rotary layout; transformers undoes it.
        return (
            w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2)
            .reshape(w.shape)
        )

    for name, array in load_file(str(model_dir / "model.safetensors")).items():
        array = array.astype(np.float32)
        if name in _GGUF_GLOBAL:
            gguf_name = _GGUF_GLOBAL[name]
        else:
            _, _, layer, *rest = name.split(".")
            part = ".".join(rest[:-1])
            gguf_name = f"blk.{layer}.{_GGUF_LAYER[part]}.weight"
            if part == "self_attn.q_proj":
                array = permute(array, n_head)
            elif part == "self_attn.k_proj":
                array = permute(array, n_kv)
        writer.add_tensor(gguf_name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def require_batch_system(command: str, what: str, hint: str, require_env: str) -> None:
    """Skip the calling module unless ``command`` answers (a batch system is here); with
    ``require_env`` set in the environment (as in CI) its absence is a failure instead."""
    problem = None
    if shutil.which(command) is None:
        problem = f"{command} is not on PATH"
    else:
        probe = subprocess.run([command], capture_output=True, text=True, timeout=60)
        if probe.returncode:
            problem = f"{command} failed: {probe.stderr.strip()}"
    if problem:
        message = f"no {what} here ({problem}){hint}"
        if os.environ.get(require_env):
            pytest.fail(message)
        pytest.skip(message)
