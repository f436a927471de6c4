"""Small models built offline, for tests and quick benchmarks.

:func:`build_tiny_llama` makes a Llama-shaped model with random weights and a tokenizer trained
on a few built-in sentences, offline and quickly: enough to exercise loading, batching and
generation without real weights. :func:`write_llama_gguf` writes such a model as
a float32 GGUF file laid out as llama.cpp's converter does, to test the GGUF path.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

from dask_pcm.templates.embedded import is_model_dir, replace_dir

_TINY_MARKER = ".pcm-tiny-llama.json"

# A small English corpus for the tiny tokenizer: facts and claims, like the texts dask_pcm's
# examples score, so that tokens of typical prompts are merged rather than left as bytes.
_CORPUS = (
    "Paris is the capital of France.",
    "Berlin is the capital of Germany.",
    "Rome is the capital of Italy.",
    "Madrid is the capital and largest city of Spain.",
    "The Eiffel Tower was completed in 1889.",
    "Water boils at 100 degrees Celsius at sea level.",
    "The Earth orbits the Sun once a year.",
    "The Moon is a natural satellite of the Earth.",
    "Mount Everest is the highest mountain above sea level.",
    "The Pacific Ocean is the largest ocean on Earth.",
    "The Amazon River flows through Brazil.",
    "The Nile is one of the longest rivers in the world.",
    "William Shakespeare wrote Hamlet and Macbeth.",
    "Marie Curie won two Nobel Prizes.",
    "Albert Einstein developed the theory of relativity.",
    "Isaac Newton described the laws of motion and gravity.",
    "The human heart has four chambers.",
    "Light travels faster than sound.",
    "Honey bees live in colonies with a single queen.",
    "Penguins are birds that cannot fly.",
    "The claim is supported by the evidence.",
    "The claim is refuted by the evidence.",
    "There is not enough information to verify the claim.",
    "This statement is true.",
    "This statement is false.",
    "The film was released in 2010 and directed by a British director.",
    "The band recorded its first album in London.",
    "The city has a population of more than one million people.",
    "The company was founded in the United States in 1976.",
    "The river is the longest in the country.",
    "The author was born in a small town and later moved to the capital.",
    "The team won the championship three times.",
    "Question: What is the capital of France? Answer: Paris.",
    "Question: Is the claim true or false? Answer: true.",
    "Question: Is the claim true or false? Answer: false.",
    "You are a helpful assistant that checks facts.",
    "The user asks a question and the assistant answers it.",
    "Read the claim and decide whether it is supported, refuted, or unverifiable.",
    "Numbers such as 1, 2, 3, 10, 42 and 100 appear in many claims.",
    "The quick brown fox jumps over the lazy dog.",
)

_TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def build_tiny_llama(
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
) -> Path:
    """Build a tiny random Llama model with a locally trained tokenizer, offline, for tests.

    Deterministic for given arguments. A complete build with the same arguments already at
    ``path`` is reused; an earlier build with other arguments is replaced, in one rename. Any
    other non-empty folder at ``path`` raises ``FileExistsError``.

    Parameters
    ----------
    path
        The model directory to create.
    seed
        Seed of the random weights.
    vocab_size
        Vocabulary size of the byte-level BPE tokenizer and of the model (at least 260).
    hidden_size, num_layers, num_heads
        Shape of the transformer; ``hidden_size`` must be divisible by ``num_heads``.

    Returns
    -------
    Path
        ``path``, a directory that ``AutoModelForCausalLM.from_pretrained`` and
        ``AutoTokenizer.from_pretrained`` load.

    Example
    -------
    >>> build_tiny_llama("/tmp/tiny-llama")  # doctest: +SKIP
    PosixPath('/tmp/tiny-llama')
    """
    out = Path(path)
    params = {
        "seed": seed,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "num_heads": num_heads,
    }
    marker = out / _TINY_MARKER
    if marker.is_file():
        try:
            if json.loads(marker.read_text()) == params and is_model_dir(out):
                return out
        except (OSError, ValueError):
            pass  # unreadable marker: rebuild
    elif out.exists() and any(out.iterdir()):
        # Not one of our builds: never replace a folder we did not make.
        raise FileExistsError(f"'{out}' exists and is not a tiny model built by build_tiny_llama")
    # 256 byte-level symbols plus the special tokens must fit in the vocabulary.
    if vocab_size < 260:
        raise ValueError(
            f"vocab_size must be at least 260 for a byte-level tokenizer, got {vocab_size}"
        )
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}")

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _train_tiny_tokenizer(vocab_size)
    model_config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    # Fork the global RNG so building a model does not change the caller's random stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(model_config)
    model.eval()

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _TINY_MARKER).write_text(json.dumps(params))
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _train_tiny_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    # A leading <s> gives every prompt, even an empty one, at least one token to predict from.
    bos_id = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        chat_template=_TINY_CHAT_TEMPLATE,
    )


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
