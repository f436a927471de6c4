"""Block-local attention for rows laid end to end after a kept prefix.

After a kept prefix, :func:`dask_pcm.engine.prefix.forward` runs a pass's rows (each
prompt's own tokens) as one sequence, end to end, so that the matrix products see no
padding. Masked attention over such a sequence scores every query against all of its keys
and hides the other rows' afterwards: its work grows with the whole sequence, not with the
row. Here each query is scored against the prefix's keys and its own row's keys up to
itself only, as the same prompt alone would be:

- :class:`Rows`: where each row's tokens sit in the sequence, as indices that lay them out
  as a block of ``[rows, longest]`` (shorter rows padded at the end) and back;
- :func:`rows_attention`: the attention function, registered with transformers' attention
  interface as :data:`NAME` (:func:`attending_by_rows`, for the length of one pass);
- :func:`applies`: whether a model's attention can be replaced so.

Why two parts: the prefix's keys are the same for every query, so its scores are one dense
product of all queries (grouped by key/value head, without copying the keys per query head);
the row's own keys come from the block. Both parts share one softmax, so the result is the
attention over the prefix and the row, to float rounding. Why a block and not the sequence:
rows of a pass have about the same length (prompts run shortest first), so the block holds
little padding, while every row of a sequence would otherwise see all of its keys.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

#: The attention implementation's name in transformers' attention interface.
NAME = "dask_pcm_rows"


@dataclass(frozen=True)
class Rows:
    """Rows laid end to end in one sequence of ``sum(lengths)`` tokens, and the indices
    that gather them into a block of ``[len(lengths), longest]`` and back (on the model's
    device).

    Attributes
    ----------
    lengths
        Tokens of each row, in the order they are laid.
    gather
        ``[rows * longest]``: the sequence position of each place of the block; a place
        after a row's end repeats the row's last token (its query is dropped, its key is
        never seen by the row's queries).
    scatter
        ``[sum(lengths)]``: the place in the block of each position of the sequence.
    later
        ``[longest, longest]``, true where a key comes after the query (hidden).
    """

    lengths: tuple[int, ...]
    gather: Any
    scatter: Any
    later: Any

    @property
    def longest(self) -> int:
        return max(self.lengths)


def rows_of(lengths: Sequence[int], device: Any = "cpu") -> Rows:
    """The :class:`Rows` of rows of ``lengths`` tokens, end to end.

    Example
    -------
    >>> rows = rows_of([2, 3])
    >>> rows.gather.tolist(), rows.scatter.tolist()
    ([0, 1, 1, 2, 3, 4], [0, 1, 3, 4, 5])
    """
    import torch

    longest = max(lengths)
    gather: list[int] = []
    scatter: list[int] = []
    start = 0
    for r, n in enumerate(lengths):
        gather += [start + min(j, n - 1) for j in range(longest)]
        scatter += range(r * longest, r * longest + n)
        start += n
    later = torch.ones(longest, longest, dtype=torch.bool).triu(1)
    return Rows(
        tuple(lengths),
        torch.tensor(gather, device=device),
        torch.tensor(scatter, device=device),
        later.to(device),
    )


def applies(model: Any) -> bool:
    """Whether :func:`rows_attention` can stand in for ``model``'s attention: a model built
    on transformers' attention interface with ``sdpa`` or ``eager`` attention, no sliding
    window and no soft-capped scores (those need a mask or a cap this function does not
    apply)."""
    config = getattr(model, "config", None)
    return (
        bool(getattr(model, "_supports_attention_backend", False))
        and getattr(config, "_attn_implementation", None) in ("sdpa", "eager")
        and not getattr(config, "sliding_window", None)
        and not any("sliding" in str(t) for t in getattr(config, "layer_types", None) or ())
        and not getattr(config, "attn_logit_softcapping", None)
    )


@contextmanager
def attending_by_rows(model: Any) -> Iterator[None]:
    """Within it, ``model``'s layers call :func:`rows_attention`; its own implementation
    again after. Only the passes of :func:`dask_pcm.engine.prefix.forward` run within, so
    generation and whole prompts keep the model's own attention, bit for bit. The model's
    config says which attention function every layer calls, for every thread: callers hold
    the model's lock (as every pass does)."""
    _register()
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = before


@functools.cache
def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, rows_attention)


def rows_attention(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    *,
    pcm_rows: Rows,
    pcm_prefix: Sequence[tuple[Any, Any]],
    **kwargs: Any,
) -> tuple[Any, None]:
    """Attention of one sequence of rows end to end (``pcm_rows``) after the kept states
    ``pcm_prefix`` (per layer, keys and values ``[1, kv_heads, prefix, head_dim]``): each
    query against the prefix's keys and its own row's keys up to itself.

    Called by the model's attention layers (transformers' attention interface) with
    ``query`` ``[1, heads, tokens, head_dim]`` and ``key``, ``value`` ``[1, kv_heads,
    tokens, head_dim]`` of the sequence's own tokens (no cache: the prefix comes as
    ``pcm_prefix``); ``attention_mask`` is ``None`` (the rows say what each query sees).
    Returns the output ``[1, tokens, heads, head_dim]`` and no weights.
    """
    import torch

    rows = pcm_rows
    prefix_keys, prefix_values = pcm_prefix[module.layer_idx]
    _, heads, tokens, dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads  # query heads per key/value head, as repeat_kv lays them
    count, longest = len(rows.lengths), rows.longest
    scale = dim**-0.5 if scaling is None else scaling

    def block(states: Any) -> Any:
        # [1, n_heads, tokens, dim] -> [kv_heads, rows * longest, n_heads // kv_heads * dim]:
        # each key/value head's part of the block, rows one after the other.
        flat = states[0].transpose(0, 1).reshape(tokens, kv_heads, -1)
        return flat.transpose(0, 1).index_select(1, rows.gather)

    queries = block(query).view(kv_heads, count * longest * group, dim)
    # The scale folded into the keys: fewer of them than scores.
    keys = block(key).mul_(scale).view(kv_heads * count, longest, dim)
    values = block(value).view(kv_heads * count, longest, dim)
    width = prefix_keys.shape[2]
    # One product per key/value head over every query of the block for the prefix; one per
    # row and head for the row's own keys. A query's scores lie side by side, so a single
    # softmax normalises over both.
    scores = queries.new_empty(kv_heads, count, longest * group, width + longest)
    scores[..., :width] = torch.matmul(queries, prefix_keys[0].transpose(1, 2) * scale).view(
        kv_heads, count, longest * group, width
    )
    own = torch.matmul(queries.view(kv_heads * count, longest * group, dim), keys.transpose(1, 2))
    hidden = rows.later[:, None, :].expand(longest, group, longest).reshape(longest * group, -1)
    scores[..., width:] = own.masked_fill_(hidden, float("-inf")).view(
        kv_heads, count, longest * group, longest
    )
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(
        weights[..., :width].reshape(kv_heads, count * longest * group, width), prefix_values[0]
    ).view(kv_heads * count, longest * group, dim)
    out.baddbmm_(weights[..., width:].reshape(kv_heads * count, longest * group, longest), values)
    # Back to the sequence's order, [tokens, heads, head_dim] with head = kv_head * group + i.
    out = out.view(kv_heads, count * longest, group * dim).transpose(0, 1)
    return out.index_select(0, rows.scatter).view(1, tokens, heads, dim), None
