"""A tiny sentence encoder built offline, and its loader: a context that is not an LLM.

:func:`build_tiny_encoder` lays out a folder as sentence-transformers does: a random
``BertModel`` saved with ``save_pretrained`` at the top, its pooling settings in
``1_Pooling/config.json`` and a WordPiece tokenizer (trained with the ``tokenizers`` library
on a few sentences) in ``tokenizer/tokenizer.json``, plus a ``README.md``. Its subfolders
and its README are what a Hugging Face model selection would leave out, so it exercises the
template transport's generic trees. :class:`MeanPoolingEncoder` is a picklable loader that
builds a :class:`SentenceEncoder` from such a folder.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dask_pcm.templates.embedded import replace_dir
from dask_pcm.testing.models import _CORPUS

POOLING = "1_Pooling/config.json"
TOKENIZER = "tokenizer/tokenizer.json"
_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def build_tiny_encoder(
    path: str | os.PathLike[str], *, seed: int = 0, hidden_size: int = 32, vocab_size: int = 300
) -> Path:
    """Build a tiny random sentence encoder folder (model, subfolders), offline.

    Deterministic for given arguments; an existing folder at ``path`` is replaced.

    Parameters
    ----------
    path
        The folder to create.
    seed
        Seed of the random weights.
    hidden_size
        Width of the model, and of its embeddings.
    vocab_size
        Most tokens of the WordPiece vocabulary.

    Returns
    -------
    Path
        ``path``, holding ``config.json``, ``model.safetensors``, ``modules.json``,
        ``README.md``, ``1_Pooling/config.json`` and ``tokenizer/tokenizer.json``.

    Example
    -------
    >>> build_tiny_encoder("/tmp/tiny-encoder")  # doctest: +SKIP
    PosixPath('/tmp/tiny-encoder')
    """
    tok, model = _tiny_bert(seed, hidden_size, vocab_size)

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        model.save_pretrained(tmp)
        (tmp / "tokenizer").mkdir()
        tok.save(str(tmp / TOKENIZER))
        (tmp / "1_Pooling").mkdir()
        pooling = {"word_embedding_dimension": hidden_size, "pooling_mode_mean_tokens": True}
        (tmp / POOLING).write_text(json.dumps(pooling, indent=1))
        modules = [
            {"idx": 0, "name": "0", "path": "", "type": "Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "Pooling"},
        ]
        (tmp / "modules.json").write_text(json.dumps(modules, indent=1))
        (tmp / "README.md").write_text("A tiny random sentence encoder for dask_pcm's tests.\n")
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _tiny_bert(seed: int, hidden_size: int, vocab_size: int) -> tuple[Any, Any]:
    """A WordPiece tokenizer trained on a few sentences and a random 2-layer BERT over it."""
    import torch
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertConfig, BertModel

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size, special_tokens=_SPECIALS, show_progress=False
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    config = BertConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=hidden_size,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=hidden_size * 2,
        max_position_embeddings=128,
        pad_token_id=tok.token_to_id("[PAD]"),
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = BertModel(config, add_pooling_layer=False)
    model.eval()
    return tok, model


def build_tiny_sentence_transformer(
    path: str | os.PathLike[str], *, seed: int = 0, hidden_size: int = 32, vocab_size: int = 300
) -> Path:
    """Build a tiny random ``sentence-transformers`` model folder, offline (a BERT and mean
    pooling, saved by ``SentenceTransformer.save``: ``modules.json``, ``1_Pooling/``...).

    Needs the ``sentence-transformers`` package. An existing folder at ``path`` is replaced.

    Example
    -------
    >>> from sentence_transformers import SentenceTransformer   # doctest: +SKIP
    >>> model = SentenceTransformer(str(build_tiny_sentence_transformer("/tmp/st")))  # doctest: +SKIP
    >>> model.encode(["Paris"]).shape                            # doctest: +SKIP
    (1, 32)
    """
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.models import Pooling, Transformer
    from transformers import PreTrainedTokenizerFast

    tok, bert = _tiny_bert(seed, hidden_size, vocab_size)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    staging = Path(f"{tmp}-bert")
    try:
        bert.save_pretrained(staging)
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
            sep_token="[SEP]", mask_token="[MASK]", model_max_length=128,
        )  # fmt: skip
        fast.save_pretrained(staging)
        modules = [Transformer(str(staging)), Pooling(hidden_size, "mean")]
        SentenceTransformer(modules=modules, device="cpu").save(str(tmp))
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


class SentenceEncoder:
    """A loaded encoder: :meth:`embed` gives one mean-pooled vector per text."""

    def __init__(self, model: Any, tokenizer: Any, dimension: int, location: str) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.dimension = dimension
        self.location = location
        self.device = "cpu"

    def embed(self, texts: list[str]) -> list[list[float]]:
        """Mean of the token states over each text's real tokens (padding left out)."""
        import torch

        encoded = self.tokenizer.encode_batch(texts)
        ids = torch.tensor([e.ids for e in encoded])
        mask = torch.tensor([e.attention_mask for e in encoded])
        with torch.no_grad():
            states = self.model(input_ids=ids, attention_mask=mask).last_hidden_state
        weights = mask.unsqueeze(-1).to(states.dtype)
        pooled = (states * weights).sum(1) / weights.sum(1).clamp(min=1)
        return pooled.tolist()


@dataclass(frozen=True)
class MeanPoolingEncoder:
    """Loader of :func:`build_tiny_encoder` folders: ``MeanPoolingEncoder()(location)``.

    Reads the pooling settings from ``1_Pooling/config.json`` and the tokenizer from
    ``tokenizer/tokenizer.json``; small and picklable, so Dask ships it to workers.

    Example
    -------
    >>> encoder = MeanPoolingEncoder()("/tmp/tiny-encoder")  # doctest: +SKIP
    >>> len(encoder.embed(["Paris is the capital of France."])[0])  # doctest: +SKIP
    32
    """

    def __call__(self, location: str | None) -> SentenceEncoder:
        if location is None:
            raise ValueError("MeanPoolingEncoder needs a template folder")
        from tokenizers import Tokenizer
        from transformers import AutoModel
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # one bar per build would flood worker logs
        root = Path(location)
        pooling = json.loads((root / POOLING).read_text())
        if not pooling.get("pooling_mode_mean_tokens"):
            raise ValueError(f"'{root / POOLING}': only mean pooling is supported")
        tokenizer = Tokenizer.from_file(str(root / TOKENIZER))
        tokenizer.enable_padding(pad_id=tokenizer.token_to_id("[PAD]"), pad_token="[PAD]")
        model = AutoModel.from_pretrained(root, add_pooling_layer=False)
        model.eval()
        return SentenceEncoder(model, tokenizer, int(pooling["word_embedding_dimension"]), location)
