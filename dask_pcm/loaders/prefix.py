"""Prompt prefixes as resident state: the key/value cache of the tokens every prompt of a
template shares (instructions, examples, the chat preamble), computed once per worker and
kept, so that a forward pass runs only each prompt's own tokens.

- :func:`shared_prefix`: how many leading tokens all prompts share *as they tokenize in full*
  (so the boundary is safe: a token that merges the prefix's last characters with a claim's
  first is not part of it), at most the tokens of a given prefix text.
- :class:`PrefixCache`: those states by token ids, least recently used first out, within a
  byte budget (``pcm.worker.prefix-cache``).
- :func:`last_logits`: one forward pass over token id lists, left-padded, from a cached
  prefix or from nothing, giving each row's next-token logits. Positions count real tokens
  only, so a padded row computes what the same prompt alone would.
"""

from __future__ import annotations

import functools
import inspect
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

# Below this many shared tokens a cache entry saves less than it costs to look up and expand.
MIN_PREFIX_TOKENS = 4

States = list[tuple[Any, Any]]  # per layer: keys and values, [1, kv_heads, tokens, head_dim]


def shared_prefix(token_lists: Sequence[Sequence[int]], limit: Sequence[int]) -> int:
    """Leading tokens that every list shares with ``limit`` (the prefix text's own tokens),
    leaving each list at least one token of its own.

    Example
    -------
    >>> shared_prefix([[1, 2, 3, 9], [1, 2, 3, 7, 8]], [1, 2, 3, 4])
    3
    >>> shared_prefix([[1, 2], [1, 2, 5]], [1, 2])  # the first keeps one token of its own
    1
    """
    if not token_lists:
        return 0
    n = min(len(limit), *(len(ids) - 1 for ids in token_lists))
    for i in range(max(0, n)):
        token = limit[i]
        if any(ids[i] != token for ids in token_lists):
            return i
    return max(0, n)


def states_bytes(states: States) -> int:
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in states)


class PrefixCache:
    """Prefix key/value states by their token ids, within ``limit`` bytes (LRU)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.nbytes = 0
        self._entries: OrderedDict[tuple[int, ...], States] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, ids: tuple[int, ...]) -> States | None:
        states = self._entries.get(ids)
        if states is not None:
            self._entries.move_to_end(ids)
        return states

    def put(self, ids: tuple[int, ...], states: States) -> None:
        size = states_bytes(states)
        if size > self.limit:
            return  # larger than the whole budget: used for this call, not kept
        while self._entries and self.nbytes + size > self.limit:
            _, dropped = self._entries.popitem(last=False)
            self.nbytes -= states_bytes(dropped)
        self._entries[ids] = states
        self.nbytes += size

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0

    def states_for(
        self, ids: Sequence[Sequence[int]], limit: Sequence[int], model: Any, device: str
    ) -> tuple[int, States | None]:
        """How many leading tokens of ``ids`` the kept states cover (those all share with
        ``limit``, the prefix text's tokens), and the states: computed on first use, kept."""
        shared = shared_prefix(ids, limit)
        if shared < MIN_PREFIX_TOKENS:
            return 0, None
        key = tuple(ids[0][:shared])
        states = self.get(key)
        if states is None:
            states = prefix_states(model, key, device)
            self.put(key, states)
        return shared, states


def cache_argument(model: Any) -> str:
    """What the model's forward calls its key/value cache: ``cache`` from transformers 5.x
    on, ``past_key_values`` before (still accepted there, with a deprecation warning)."""
    return _cache_argument_of(type(model).forward)


@functools.cache
def _cache_argument_of(forward: Any) -> str:
    parameters = inspect.signature(forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def to_device(tensor: Any, device: str) -> Any:
    """Inputs go to the model's device here, one place (tests watch it)."""
    return tensor.to(device)


def prefix_states(model: Any, ids: Sequence[int], device: str) -> States:
    """Run the prefix once; its key/value states per layer."""
    import torch

    with torch.inference_mode():
        out = model(
            input_ids=to_device(torch.tensor([list(ids)]), device),
            use_cache=True,
            logits_to_keep=1,
        )
    cache = out.cache if hasattr(out, "cache") else out.past_key_values
    return [(layer.keys, layer.values) for layer in cache.layers]


def last_logits(
    model: Any,
    rows: Sequence[Sequence[int]],
    pad_id: int,
    device: str,
    prefix: States | None = None,
    prefix_len: int = 0,
) -> Any:
    """Next-token logits after each row (token ids following ``prefix_len`` cached tokens),
    as float32 on the CPU, shape ``[len(rows), vocab]``."""
    return forward(model, rows, pad_id, device, prefix, prefix_len, keep=1)[:, -1, :].float().cpu()


def forward(
    model: Any,
    rows: Sequence[Sequence[int]],
    pad_id: int,
    device: str,
    prefix: States | None = None,
    prefix_len: int = 0,
    keep: int = 1,
) -> Any:
    """The logits of the last ``keep`` positions of one pass over ``rows`` (token ids after
    ``prefix_len`` cached tokens, padded on the left), on the model's device."""
    import torch
    from transformers import DynamicCache

    input_ids, mask, positions = left_padded(rows, pad_id, prefix_len)
    cache = None
    if prefix is not None:
        # A fresh cache per pass over views of the kept states: the pass appends to its own
        # copy (torch.cat), never to what is kept.
        batch = len(rows)
        expanded = [(k.expand(batch, -1, -1, -1), v.expand(batch, -1, -1, -1)) for k, v in prefix]
        cache = DynamicCache(ddp_cache_data=expanded, config=model.config)
    with torch.inference_mode():
        out = model(
            input_ids=to_device(input_ids, device),
            attention_mask=to_device(mask, device),
            position_ids=to_device(positions, device),
            use_cache=cache is not None,
            logits_to_keep=keep,
            **({} if cache is None else {cache_argument(model): cache}),
        )
    return out.logits


def left_padded(rows: Sequence[Sequence[int]], pad_id: int, prefix_len: int = 0) -> tuple[Any, ...]:
    """``input_ids``, ``attention_mask`` (``prefix_len`` cached tokens included) and
    ``position_ids`` of ``rows`` padded on the left, as CPU tensors.

    Example
    -------
    >>> ids, mask, positions = left_padded([[5, 6, 7], [8]], pad_id=0)
    >>> ids.tolist(), mask.tolist(), positions.tolist()
    ([[5, 6, 7], [0, 0, 8]], [[1, 1, 1], [0, 0, 1]], [[0, 1, 2], [0, 0, 0]])
    """
    import torch

    width = max(len(r) for r in rows)
    batch = len(rows)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)
    mask = torch.zeros((batch, prefix_len + width), dtype=torch.long)
    mask[:, :prefix_len] = 1
    positions = torch.full((batch, width), prefix_len, dtype=torch.long)
    for i, row in enumerate(rows):
        n = len(row)
        if n:
            input_ids[i, width - n :] = torch.tensor(list(row), dtype=torch.long)
            mask[i, prefix_len + width - n :] = 1
            positions[i, width - n :] = torch.arange(prefix_len, prefix_len + n)
    return input_ids, mask, positions
