"""Prompt prefixes as resident state: the key/value cache of the tokens every prompt of a
template shares (instructions, examples, the chat preamble), computed once per worker and
kept, so that a forward pass runs only each prompt's own tokens.

- :func:`shared_prefix`: how many leading tokens all prompts share *as they tokenize in full*
  (so the boundary is safe: a token that merges the prefix's last characters with a claim's
  first is not part of it), at most the tokens of a given prefix text.
- :class:`PrefixCache`: those states by token ids, least recently used first out, within a
  byte budget (``pcm.worker.prefix-cache``).
- :func:`forward`: one forward pass over token id lists, from a cached prefix or from
  nothing, giving the logits of each row's last positions. Positions count real tokens
  only, so a row computes what the same prompt alone would. Whole prompts are padded on the
  left (:func:`left_padded`). Rows after a kept prefix are laid end to end, so that no
  position is padding and the prefix's states enter the pass once, not once per row: in one
  sequence, with block-local attention (:func:`by_rows`, :mod:`dask_pcm.engine.attention`:
  each query scored against the prefix and its own row only) where the model's attention
  allows it; else *packed* (:func:`packed`) in sequences of up to :data:`PACK_TOKENS`
  tokens under a mask that lets each row see the prefix and its own tokens.
- :func:`last_logits`: each row's next-token logits, on the CPU.

Why rows are packed, and the head gets a contiguous copy: before, a pass after a kept prefix
spent much of its time on padding to the longest row of the pass, on the language-model head
over a non-contiguous slice of the hidden states (a batched matmul over a copy of the
weights per row) and on the prefix's states concatenated once per row in every layer. Why
block-local attention: under the mask, every query of a packed sequence is still scored
against all of the sequence's keys, so attention took a growing share of a pass.
"""

from __future__ import annotations

import functools
import inspect
import itertools
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from dask_pcm.engine.attention import BLOCK_TOKENS, applies, attending_by_rows, blocks_of

# Below this many shared tokens a cache entry saves less than it costs to look up and expand.
MIN_PREFIX_TOKENS = 4
# Tokens per packed sequence; a pass after a kept prefix takes as many sequences as it would
# take whole prompts (passes.in_passes). Under the mask every query of a packed sequence is
# computed against all of its keys (the other rows' hidden), so attention grows with the
# sequence while the fixed costs of a pass (reading the weights, the head) shrink per token:
# between the two, a small model on a CPU runs the most positions per second at a few hundred
# tokens. With block-local attention (by_rows) a pass's sequences run as one, without padding.
PACK_TOKENS = 256

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


def packable(model: Any) -> bool:
    """Whether rows after a kept prefix may be packed for ``model``: its attention takes a
    custom 4D mask as given (transformers' attention interface with ``sdpa`` or ``eager``)
    and no layer looks through a sliding window (a mask of our own would not apply it)."""
    config = getattr(model, "config", None)
    return (
        bool(getattr(model, "_supports_attention_backend", False))
        and getattr(config, "_attn_implementation", None) in ("sdpa", "eager")
        and not getattr(config, "sliding_window", None)
        and not any("sliding" in str(t) for t in getattr(config, "layer_types", None) or ())
    )


def pack(lengths: Sequence[int], limit: int) -> list[list[int]]:
    """Row indices laid end to end, in order, in sequences of at most ``limit`` tokens (a row
    longer than ``limit`` alone).

    Example
    -------
    >>> pack([3, 4, 2, 6, 1], limit=8)
    [[0, 1], [2, 3], [4]]
    """
    sequences: list[list[int]] = []
    used = limit + 1
    for i, n in enumerate(lengths):
        if used + n > limit:
            sequences.append([])
            used = 0
        sequences[-1].append(i)
        used += n
    return sequences


def balanced(lengths: Sequence[int], limit: int) -> list[list[int]]:
    """As :func:`pack`, in as few sequences, with the longest as short as it can be: the
    pass is as wide as its longest sequence, so 16 rows of 18 tokens under a limit of 256
    make two sequences of 144, not one of 252 and one of 36 padded to 252.

    Example
    -------
    >>> balanced([18] * 4, limit=64)
    [[0, 1], [2, 3]]
    """
    sequences = pack(lengths, limit)
    if len(sequences) < 2 or max(lengths) >= limit:
        return sequences
    # The narrowest width that still packs into as many sequences (packing in order is
    # greedy: a wider limit never needs more sequences).
    low, high = max(max(lengths), -(-sum(lengths) // len(sequences))), limit
    while low < high:
        middle = (low + high) // 2
        if len(pack(lengths, middle)) <= len(sequences):
            high = middle
        else:
            low = middle + 1
    return pack(lengths, low)


def forward(
    model: Any,
    rows: Sequence[Sequence[int]],
    pad_id: int,
    device: str,
    prefix: States | None = None,
    prefix_len: int = 0,
    keep: int = 1,
) -> Any:
    """The logits of each row's last ``keep`` positions in one pass over ``rows`` (token ids
    after ``prefix_len`` cached tokens), on the model's device, ``[len(rows), keep, vocab]``:
    row ``i``'s token ``j`` (of ``n``) at column ``keep - n + j``; the columns before a row
    shorter than ``keep`` hold nothing of it.

    After a kept prefix the rows run end to end with block-local attention
    (:func:`by_rows`) where the model's attention allows it
    (:func:`~dask_pcm.engine.attention.applies`), else packed under a mask (:func:`packed`)
    where the model takes one (:func:`packable`); whole prompts are padded on the left
    (:func:`left_padded`).
    """
    import torch
    from transformers import DynamicCache

    if prefix is not None and applies(model):
        return by_rows(model, rows, device, prefix, prefix_len, keep)
    lengths = [len(r) for r in rows]
    is_packed = prefix is not None and packable(model)
    if is_packed:
        sequences = balanced(lengths, PACK_TOKENS)
        input_ids, mask, positions, starts = packed(rows, sequences, pad_id, prefix_len)
        if getattr(model.config, "_attn_implementation", None) == "eager":
            # eager attention adds the mask to its scores
            low = torch.finfo(model.dtype).min
            mask = torch.zeros(mask.shape, dtype=model.dtype).masked_fill(~mask, low)
        # Each row's last positions, picked by column: the head gets a contiguous copy of a
        # few hidden states. A column kept for one sequence is computed for all (transformers
        # >= 4.56 takes one index for every sequence).
        spans = [
            range(start + n - min(keep, n), start + n)
            for (_, start), n in zip(starts, lengths, strict=True)
        ]
        columns = sorted({c for span in spans for c in span})
    else:
        input_ids, mask, positions = left_padded(rows, pad_id, prefix_len)
        width = input_ids.shape[1]
        # By index, not logits_to_keep=keep: an int hands the head a strided slice of the
        # hidden states, which it multiplies as a batched matmul over one copy of its weights
        # per row (slower than the same product on a contiguous copy).
        columns = list(range(max(0, width - keep), width))
    cache = None
    if prefix is not None:
        # A fresh cache per pass over views of the kept states: the pass appends to its own
        # copy (torch.cat), never to what is kept.
        batch = input_ids.shape[0]
        expanded = [(k.expand(batch, -1, -1, -1), v.expand(batch, -1, -1, -1)) for k, v in prefix]
        cache = DynamicCache(ddp_cache_data=expanded, config=model.config)
    with torch.inference_mode():
        out = model(
            input_ids=to_device(input_ids, device),
            attention_mask=to_device(mask, device),
            position_ids=to_device(positions, device),
            use_cache=cache is not None,
            logits_to_keep=to_device(torch.tensor(columns), device),
            **({} if cache is None else {cache_argument(model): cache}),
        )
        kept = out.logits  # [sequences, columns, vocab]
        if not is_packed:
            short = keep - kept.shape[1]
            return kept if short <= 0 else torch.nn.functional.pad(kept, (0, 0, short, 0))
        where = {c: j for j, c in enumerate(columns)}
        sequence = torch.tensor([[seq] for seq, _ in starts])
        # A row shorter than keep repeats its first kept column before it.
        index = torch.tensor(
            [[where[span[max(0, k - keep + len(span))]] for k in range(keep)] for span in spans]
        )
        logits = kept[to_device(sequence, kept.device), to_device(index, kept.device)]
    return logits


def by_rows(
    model: Any,
    rows: Sequence[Sequence[int]],
    device: str,
    prefix: States,
    prefix_len: int,
    keep: int = 1,
) -> Any:
    """:func:`forward` after a kept prefix with block-local attention
    (:mod:`dask_pcm.engine.attention`): ``rows`` end to end in one sequence, no padding;
    for attention alone, laid as :func:`packed` lays rows in sequences, in blocks of up to
    :data:`~dask_pcm.engine.attention.BLOCK_TOKENS` tokens (:func:`balanced`); the logits
    as :func:`forward` gives them."""
    import torch

    lengths = [len(r) for r in rows]
    input_ids = torch.tensor([[t for row in rows for t in row]], dtype=torch.long)
    positions = torch.tensor([[prefix_len + j for n in lengths for j in range(n)]])
    _, mask, _, starts = packed(rows, balanced(lengths, BLOCK_TOKENS), 0, prefix_len)
    blocks = blocks_of(lengths, starts, mask, model.dtype, device)
    # Each row's last positions, the head's only columns (a contiguous copy of a few hidden
    # states, see forward).
    ends = list(itertools.accumulate(lengths))
    spans = [range(end - min(keep, n), end) for end, n in zip(ends, lengths, strict=True)]
    columns = [c for span in spans for c in span]
    with attending_by_rows(model), torch.inference_mode():
        out = model(
            input_ids=to_device(input_ids, device),
            position_ids=to_device(positions, device),
            use_cache=False,
            logits_to_keep=to_device(torch.tensor(columns), device),
            pcm_blocks=blocks,
            pcm_prefix=prefix,
        )
        kept = out.logits[0]  # [columns, vocab]
        firsts = itertools.accumulate((len(span) for span in spans), initial=0)
        # A row shorter than keep repeats its first kept column before it.
        index = torch.tensor(
            [
                [first + max(0, k - keep + len(span)) for k in range(keep)]
                for first, span in zip(firsts, spans, strict=False)
            ]
        )
        return kept[to_device(index, kept.device)]


def packed(
    rows: Sequence[Sequence[int]], sequences: list[list[int]], pad_id: int, prefix_len: int
) -> tuple[Any, Any, Any, list[tuple[int, int]]]:
    """``rows`` laid end to end as ``sequences`` (lists of row indices, :func:`pack`), each
    padded on the left: ``input_ids`` and ``position_ids`` ``[sequences, width]``, a boolean
    attention mask ``[sequences, 1, width, prefix_len + width]`` (every query sees the
    ``prefix_len`` cached tokens and its own row's tokens up to itself; a padding query sees
    itself as well), and where each row begins: ``(sequence, column)``. CPU tensors.

    Example
    -------
    >>> ids, mask, positions, starts = packed([[5, 6], [7], [8]], [[0, 1], [2]], 0, 1)
    >>> ids.tolist(), positions.tolist(), starts
    ([[5, 6, 7], [0, 0, 8]], [[1, 2, 1], [1, 1, 1]], [(0, 0), (0, 2), (1, 2)])
    >>> mask[0, 0].int().tolist()
    [[1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]]
    """
    import torch

    width = max(sum(len(rows[i]) for i in seq) for seq in sequences)
    count = len(sequences)
    input_ids = torch.full((count, width), pad_id, dtype=torch.long)
    positions = torch.full((count, width), prefix_len, dtype=torch.long)
    owner = torch.full((count, width), -1, dtype=torch.long)  # the row of each column
    starts: list[tuple[int, int]] = [(0, 0)] * len(rows)
    for s, seq in enumerate(sequences):
        column = width - sum(len(rows[i]) for i in seq)
        for i in seq:
            n = len(rows[i])
            input_ids[s, column : column + n] = torch.tensor(list(rows[i]), dtype=torch.long)
            positions[s, column : column + n] = torch.arange(prefix_len, prefix_len + n)
            owner[s, column : column + n] = i
            starts[i] = (s, column)
            column += n
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    own = (owner[:, :, None] == owner[:, None, :]) & (owner[:, None, :] >= 0) & causal
    own |= torch.eye(width, dtype=torch.bool)
    mask = torch.ones((count, 1, width, prefix_len + width), dtype=torch.bool)
    mask[:, 0, :, prefix_len:] = own
    return input_ids, mask, positions, starts


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
