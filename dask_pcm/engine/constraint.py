"""Decoding constrained to a JSON Schema: every text generated is JSON valid against it.

One matcher per row follows the row's tokens through the schema's grammar; before each pick
the tokens it cannot take next get ``-inf`` logits (:func:`constrained`, a
:data:`~dask_pcm.engine.generation.Pick` around another), and the token picked moves it on.
Once its grammar is complete the matcher allows only an end-of-sequence token, which ends
the row as any end-of-sequence token does.

The matchers are llguidance's: it covers most of JSON Schema (``$ref``, ``anyOf``, formats,
patterns, lengths, numeric bounds), computes a token mask in Rust on the CPU in microseconds,
works with any fast Hugging Face tokenizer and needs no CUDA; it is one of vLLM's
structured-output backends. Its tokenizer, built from the Hugging Face one in milliseconds to
a second by vocabulary size, is kept per tokenizer.

Callers hold the model's lock (the tokenizer is shared).
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Sequence
from typing import Any

from dask_pcm.engine.generation import Pick

# Per Hugging Face tokenizer: llguidance's tokenizer for each set of end-of-sequence ids.
_TOKENIZERS: weakref.WeakKeyDictionary[Any, dict[tuple[int, ...], Any]] = (
    weakref.WeakKeyDictionary()
)
# No whitespace between JSON tokens unless a schema's "x-guidance" asks for it: a model free
# to write spaces and newlines (a small or random one) may write nothing else until the limit.
_COMPACT = {"whitespace_flexible": False}


def _llg_tokenizer(tokenizer: Any, eos: set[int]) -> Any:
    import llguidance.hf

    key = tuple(sorted(eos))
    try:
        known = _TOKENIZERS.setdefault(tokenizer, {})
    except TypeError:  # not weakly referable: built each time
        known = {}
    if key not in known:
        known[key] = llguidance.hf.from_tokenizer(tokenizer, eos_token=list(key) or None)
    return known[key]


def json_matchers(tokenizer: Any, eos: set[int], schema: dict[str, Any], rows: int) -> list[Any]:
    """``rows`` matchers of JSON texts valid against ``schema``, each at the start of its
    text; ValueError naming the problem where llguidance cannot compile the schema.

    Example
    -------
    >>> json_matchers(tokenizer, {2}, {"type": "object"}, 4)  # doctest: +SKIP
    [<LLMatcher>, <LLMatcher>, <LLMatcher>, <LLMatcher>]
    """
    import llguidance

    try:
        text = json.dumps(schema)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"json_schema is not JSON: {exc}") from None
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(text, defaults=_COMPACT)  # type: ignore[arg-type]
    except ValueError as exc:
        raise ValueError(f"json_schema cannot be used: {exc}") from None
    first = llguidance.LLMatcher(_llg_tokenizer(tokenizer, eos), grammar, log_level=0)
    if first.is_error():
        raise ValueError(f"json_schema cannot be used: {first.get_error()}")
    return [first, *(first.deep_copy() for _ in range(rows - 1))] if rows else []


def constrained(pick: Pick, matchers: Sequence[Any], eos: set[int]) -> Pick:
    """A :data:`~dask_pcm.engine.generation.Pick` that picks as ``pick`` does among the
    tokens row ``i``'s matcher ``matchers[i]`` allows, and moves the matcher on by the
    token picked. A stopped matcher (its grammar complete, or its row ended by an
    end-of-sequence token) allows the ``eos`` tokens only and takes no more tokens: rows
    that ended are still picked for until every row of the pass has."""
    import numpy as np
    import torch

    ends = sorted(eos)

    def pick_allowed(logits: Any) -> list[int]:
        rows, width = logits.shape
        allowed = np.zeros((rows, width), dtype=bool)
        for row, matcher in enumerate(matchers):
            if not matcher.is_stopped():
                bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
                mask = np.unpackbits(bits, bitorder="little")[:width].astype(bool)
                allowed[row, : len(mask)] = mask
            if matcher.is_stopped() or not allowed[row].any():
                allowed[row, ends] = True
        chosen = pick(logits.masked_fill(~torch.from_numpy(allowed), float("-inf")))
        for matcher, token in zip(matchers, chosen, strict=True):
            if not matcher.is_stopped() and not matcher.consume_token(token):
                raise RuntimeError(f"token {token} broke the JSON grammar: {matcher.get_error()}")
        return chosen

    return pick_allowed
