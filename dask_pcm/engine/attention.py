"""Block-local attention for rows laid end to end after a kept prefix.

After a kept prefix, :func:`dask_pcm.engine.prefix.by_rows` runs a pass's rows (each
prompt's own tokens) as one sequence, end to end, so that the matrix products see no
padding. Masked attention over such a sequence would score every query against all of its
keys and hide the other rows' afterwards: work that grows with the whole sequence, not with
the row. Here attention alone regroups the rows into *blocks* of whole rows of up to
:data:`BLOCK_TOKENS` tokens, and each query is scored against the prefix's keys and its
block's keys, under a mask that lets it see its own row up to itself only, as the same
prompt alone would:

- :class:`Blocks`: where the sequence's positions sit in the blocks, and the mask;
- :func:`rows_attention`: the attention function, registered with transformers' attention
  interface as :data:`NAME` and set on the model for the length of one pass
  (:func:`attending_by_rows`);
- :func:`applies`: whether a model's attention can be replaced so.

Why blocks of a few rows, not the sequence and not one row each: a query's work is the
prefix plus its block, so shorter blocks waste fewer keys, while every block copies the
prefix's keys and values once and a fused attention kernel runs tiny problems poorly; rows
of one pass differ in length (prompts run shortest first, but a pass holds the short and
the long of a task), so a block of rows wastes less than a block per row padded to the
longest. The matrix products before and after attention stay on the one sequence.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

#: The attention implementation's name in transformers' attention interface.
NAME = "dask_pcm_rows"
#: Most tokens of a block (a row longer than this is a block alone).
BLOCK_TOKENS = 64


@dataclass(frozen=True)
class Blocks:
    """Rows laid end to end in one sequence, regrouped for attention into blocks of whole
    rows (on the model's device).

    Attributes
    ----------
    gather
        ``[blocks * width]``: the sequence position of each place of the blocks, block
        after block; a padding place repeats a position of its block (its query is
        dropped, its key seen by no row).
    scatter
        ``[tokens]``: the place of each position of the sequence.
    mask
        ``[blocks, 1, width, prefix + width]``, additive (0 where a place's query sees the
        key, the dtype's lowest value where not): the prefix, and its own row up to itself.
    """

    gather: Any
    scatter: Any
    mask: Any

    @property
    def count(self) -> int:
        return int(self.mask.shape[0])

    @property
    def width(self) -> int:
        return int(self.mask.shape[2])


def blocks_of(
    lengths: Sequence[int], starts: Sequence[tuple[int, int]], mask: Any, dtype: Any, device: Any
) -> Blocks:
    """:class:`Blocks` of rows of ``lengths`` tokens (in the order laid end to end) placed
    as :func:`dask_pcm.engine.prefix.packed` places rows in sequences: row ``i`` at
    ``starts[i]`` (block, column), padded on the left, ``mask`` its boolean mask.

    Example
    -------
    >>> import torch
    >>> from dask_pcm.engine.prefix import packed
    >>> _, mask, _, starts = packed([[5, 6], [7], [8, 9, 4]], [[0, 1], [2]], 0, 1)
    >>> blocks = blocks_of([2, 1, 3], starts, mask, torch.float32, "cpu")
    >>> blocks.gather.tolist(), blocks.scatter.tolist()
    ([0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5])
    """
    import torch

    count, width = int(mask.shape[0]), int(mask.shape[2])
    gather = [-1] * (count * width)
    scatter: list[int] = []
    position = 0
    for (block, column), n in zip(starts, lengths, strict=True):
        first = block * width + column
        gather[first : first + n] = range(position, position + n)
        scatter += range(first, first + n)
        position += n
    for block in range(count):  # the left padding: the block's first real token
        places = gather[block * width : (block + 1) * width]
        real = next(p for p in places if p >= 0)
        gather[block * width : (block + 1) * width] = [real if p < 0 else p for p in places]
    additive = torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, torch.finfo(dtype).min)
    return Blocks(
        torch.tensor(gather, device=device),
        torch.tensor(scatter, device=device),
        additive.to(device),
    )


def applies(model: Any) -> bool:
    """Whether :func:`rows_attention` stands in for ``model``'s attention after a kept
    prefix: a model on a CPU built on transformers' attention interface with ``sdpa`` or
    ``eager`` attention, no sliding window and no soft-capped scores (a mask or a cap this
    function does not apply).

    On a GPU the masked packing stays (:func:`dask_pcm.engine.prefix.packed`): there the
    blocks' copies of the prefix's keys and values (one per block rather than one per
    sequence of :data:`~dask_pcm.engine.prefix.PACK_TOKENS`) would cost memory that the
    pass sizes (:func:`dask_pcm.engine.gpu.prompt_bytes`) do not reserve, and a fused
    kernel's work on masked keys weighs less.
    """
    config = getattr(model, "config", None)
    device = getattr(model, "device", None)
    return (
        getattr(device, "type", None) == "cpu"
        and bool(getattr(model, "_supports_attention_backend", False))
        and getattr(config, "_attn_implementation", None) in ("sdpa", "eager")
        and not getattr(config, "sliding_window", None)
        and not any("sliding" in str(t) for t in getattr(config, "layer_types", None) or ())
        and not getattr(config, "attn_logit_softcapping", None)
    )


@contextmanager
def attending_by_rows(model: Any) -> Iterator[None]:
    """Within it, ``model``'s layers call :func:`rows_attention`; its own implementation
    again after. Only the passes of :func:`dask_pcm.engine.prefix.by_rows` run within, so
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
    pcm_blocks: Blocks,
    pcm_prefix: Sequence[tuple[Any, Any]],
    **kwargs: Any,
) -> tuple[Any, None]:
    """Attention of one sequence of rows end to end after the kept states ``pcm_prefix``
    (per layer, keys and values ``[1, kv_heads, prefix, head_dim]``), in ``pcm_blocks``:
    each query against the prefix's keys and its own row's keys up to itself.

    Called by the model's attention layers (transformers' attention interface) with
    ``query`` ``[1, heads, tokens, head_dim]`` and ``key``, ``value`` ``[1, kv_heads,
    tokens, head_dim]`` of the sequence's own tokens (no cache: the prefix comes as
    ``pcm_prefix``); ``attention_mask`` is ``None`` (the blocks' mask says what each query
    sees). Returns the output ``[1, tokens, heads, head_dim]`` and no weights.
    """
    import torch

    blocks = pcm_blocks
    prefix_keys, prefix_values = pcm_prefix[module.layer_idx]
    tokens, count, width = query.shape[2], blocks.count, blocks.width

    def placed(states: Any) -> Any:
        # [1, n, tokens, dim] -> [blocks, n, width, dim]: the layers lay a token's heads
        # side by side, so the rows are gathered whole.
        _, n, _, dim = states.shape
        flat = states[0].transpose(0, 1).reshape(tokens, n * dim)
        return flat.index_select(0, blocks.gather).view(count, width, n, dim).transpose(1, 2)

    keys = torch.cat([prefix_keys.expand(count, -1, -1, -1), placed(key)], dim=2)
    values = torch.cat([prefix_values.expand(count, -1, -1, -1), placed(value)], dim=2)
    # Grouped-query heads attend to their key/value head in the kernel, without copies.
    out = torch.nn.functional.scaled_dot_product_attention(
        placed(query), keys, values, attn_mask=blocks.mask, scale=scaling, enable_gqa=True
    )
    heads, dim = out.shape[1], out.shape[3]
    out = out.transpose(1, 2).reshape(count * width, heads, dim).index_select(0, blocks.scatter)
    return out[None], None
