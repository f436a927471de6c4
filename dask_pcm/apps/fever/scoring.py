"""Scoring claims with a language model: which label does it give each claim?

Two methods, the same for every prompt template:

- ``"logits"`` (default): one forward pass per batch. Each label's score is the model's
  log-probability of the first token of that label's answer word after the prompt, taking the
  more likely of the word with and without a leading space (prompts ending in ``"Answer:"``
  want ``" True"``, chat prompts ending in a new assistant turn want ``"True"``). The label with
  the highest score is the prediction, so every claim gets a label.
- ``"generate"``: greedy generation of a few tokens, then the first answer word found in the
  text (case-insensitive, whole words) is the verdict. Text naming no answer word is
  :data:`UNPARSEABLE`, never a label.
"""

from __future__ import annotations

import contextlib
import math
import re
import weakref
from collections.abc import Sequence
from typing import Any

from dask_pcm.apps.fever.data import LABELS

METHODS = ("logits", "generate")
#: Tokens method ``"generate"`` generates per prompt.
GENERATE_TOKENS = 6
UNPARSEABLE = "UNPARSEABLE"
"""The ``predicted`` value of a generated answer that names no label."""


def check_method(method: str) -> str:
    """Return ``method`` if known, else raise ``ValueError`` listing the methods."""
    if method not in METHODS:
        raise ValueError(f"unknown scoring method {method!r}: use one of {', '.join(METHODS)}")
    return method


def answer_token_ids(tokenizer: Any, answers: Sequence[str]) -> list[tuple[int, ...]]:
    """For each answer word, the ids of its possible first tokens (with/without a space).

    Raises ``ValueError`` when two labels' answers share a first token: their likelihoods
    could not be told apart in one forward pass.
    """
    key = tuple(answers)
    # Cached per tokenizer object (weakly, so per-task contexts are not kept alive): a
    # resident context scores thousands of batches with the same few answer sets.
    cache = _ANSWER_IDS.setdefault(tokenizer, {})
    if key not in cache:
        cache[key] = _answer_ids(tokenizer, key)
    return list(cache[key])


_ANSWER_IDS: weakref.WeakKeyDictionary[Any, dict[tuple[str, ...], tuple[tuple[int, ...], ...]]] = (
    weakref.WeakKeyDictionary()
)


def _answer_ids(tokenizer: Any, answers: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    ids: list[tuple[int, ...]] = []
    for word in answers:
        variants = []
        for text in (word, " " + word):
            tokens = tokenizer.encode(text, add_special_tokens=False)
            # A tokenizer without a " word" token starts with a bare space, which every label
            # shares and so says nothing; the variant without the space still counts.
            if tokens and tokens[0] not in variants and tokenizer.decode(tokens[:1]).strip():
                variants.append(tokens[0])
        if not variants:
            raise ValueError(f"answer word {word!r} encodes to no tokens")
        ids.append(tuple(variants))
    seen: dict[int, int] = {}
    for index, firsts in enumerate(ids):
        for token in firsts:
            if seen.setdefault(token, index) != index:
                raise ValueError(
                    f"answers {answers[seen[token]]!r} and {answers[index]!r} share their "
                    f"first token {tokenizer.decode([token])!r}: choose answer words that "
                    "start differently"
                )
    return tuple(ids)


def score_logits(
    lm: Any, prompts: Sequence[str], answers: Sequence[str], prefix: str | None = None
) -> list[dict[str, Any]]:
    """Score a batch of ready prompts by next-token likelihood (one forward pass).

    ``prefix``: text all ``prompts`` start with (the template's part before the claim); the
    model keeps its key/value states and runs only the rest of each prompt (see
    :meth:`dask_pcm.LanguageModel.next_token_logits`).

    Returns one dict per prompt: ``predicted`` (a label) and ``score_<LABEL>`` (the label's
    log-probability).
    """
    import torch

    # The tokenizer is one thread's at a time (a fast tokenizer shared by threads fails with
    # "Already borrowed"): a LanguageModel's lock guards it.
    with getattr(lm, "lock", None) or contextlib.nullcontext():
        ids = answer_token_ids(lm.tokenizer, answers)
    wanted = sorted({t for variants in ids for t in variants})
    column = {t: j for j, t in enumerate(wanted)}
    # On the Hugging Face engine one forward pass and a log-softmax; on vLLM those ids'
    # log-probabilities as it computes them.
    logprobs = lm.next_token_logprobs(prompts, wanted, prefix)
    per_label = torch.stack(
        [logprobs[:, [column[t] for t in v]].logsumexp(-1) for v in ids], dim=-1
    )
    best = per_label.argmax(-1).tolist()
    rows = []
    for i, scores in enumerate(per_label.tolist()):
        row: dict[str, Any] = {"predicted": LABELS[best[i]]}
        row.update({f"score_{label}": float(s) for label, s in zip(LABELS, scores, strict=True)})
        rows.append(row)
    return rows


def parse_verdict(text: str, answers: Sequence[str]) -> str:
    """The label whose answer word appears first in ``text``, or :data:`UNPARSEABLE`.

    Example
    -------
    >>> parse_verdict(" False. The claim is wrong.", ("True", "False", "Unknown"))
    'REFUTES'
    >>> parse_verdict(" I cannot say.", ("True", "False", "Unknown"))
    'UNPARSEABLE'
    """
    best, where = UNPARSEABLE, math.inf
    for label, word in zip(LABELS, answers, strict=True):
        match = re.search(rf"(?<![\w]){re.escape(word)}(?![\w])", text, flags=re.IGNORECASE)
        if match and match.start() < where:
            best, where = label, match.start()
    return best


def score_generate(
    lm: Any,
    prompts: Sequence[str],
    answers: Sequence[str],
    max_new_tokens: int = GENERATE_TOKENS,
    prefix: str | None = None,
) -> list[dict[str, Any]]:
    """Score a batch of ready prompts by generating a short answer and parsing it.

    ``prefix``: text all ``prompts`` start with, whose key/value states the model keeps (see
    :meth:`dask_pcm.LanguageModel.generate`): the same text, generated from the rest.

    Returns one dict per prompt: ``predicted`` (a label or :data:`UNPARSEABLE`) and
    ``generated`` (the text).
    """
    texts = (
        lm.generate(prompts, max_new_tokens=max_new_tokens)
        if prefix is None
        else lm.generate(prompts, max_new_tokens=max_new_tokens, prefix=prefix)
    )
    return [{"predicted": parse_verdict(t, answers), "generated": t} for t in texts]
