"""How a :class:`~dask_pcm.engine.model.LanguageModel`'s work is cut into forward passes.

- :func:`by_length`: prompts tokenized, their kept prefix found (:func:`kept_prefix`), the
  rest run shortest first, the results back in the prompts' order;
- :func:`prefix_groups`: the rows of a unit in groups that begin alike, each to run after
  prefix states of its own (one odd prompt costs the others nothing);
- :func:`in_passes`: items in passes that fit the device: at most ``batch_size`` rows, fewer
  where the memory budget does not hold them (:func:`rows_for`); rows after a kept prefix
  packed (:func:`~dask_pcm.engine.prefix.pack`), a pass then holding as many packed
  sequences as it would rows; a pass that runs out of memory retried at half the rows, the
  smaller ``batch_size`` kept.

Every function takes the model's lock (``lm.lock``, reentrant) while it works.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable, Sequence
from typing import Any

from dask_pcm.engine.gpu import (
    free_cached_memory,
    halved,
    is_out_of_memory,
    prompt_bytes,
    rows_that_fit,
)
from dask_pcm.engine.prefix import PACK_TOKENS, States, pack, packable

# The functions take a dask_pcm.engine.model.LanguageModel, which calls them (so its type is
# not imported here, not even for type checking: the package's modules import in one direction).
LanguageModel = Any


#: Leading tokens that rows must share to run as a group of their own after kept states:
#: below it, another group's extra passes cost more than the tokens its prefix saves.
GROUP_TOKENS = 32


def prefix_groups(ids: Sequence[Sequence[int]], least: int = GROUP_TOKENS) -> list[list[int]]:
    """Indices of ``ids`` in groups: rows that share at least ``least`` leading tokens with
    another row go together (the longest shared runs: consecutive rows in sorted order),
    and the rows that share that much with none form one more group; each group's indices
    ascending. One group of all rows when they all share ``least`` tokens, or none do.

    Example
    -------
    >>> prefix_groups([[1, 2, 3, 9], [5, 6], [1, 2, 3, 8], [7]], least=3)
    [[0, 2], [1, 3]]
    """
    if len(ids) < 2:
        return [list(range(len(ids)))]
    order = sorted(range(len(ids)), key=lambda i: list(ids[i]))
    groups: list[list[int]] = []
    rest: list[int] = []
    run = [order[0]]
    for before, i in itertools.pairwise(order):
        if _common(ids[before], ids[i]) >= least:
            run.append(i)
            continue
        _close(run, groups, rest)
        run = [i]
    _close(run, groups, rest)
    if rest:
        groups.append(rest)
    return sorted(sorted(g) for g in groups)


def _close(run: list[int], groups: list[list[int]], rest: list[int]) -> None:
    if len(run) > 1:
        groups.append(run)
    else:
        rest.extend(run)


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def kept_prefix(
    lm: LanguageModel, ids: Sequence[Sequence[int]], prefix: str | Sequence[int] | None
) -> tuple[int, States | None]:
    """How many leading tokens of every one of ``ids`` kept prefix states of ``lm`` cover,
    and the states (computed on first use, then kept in ``lm.prefix_cache``): the tokens all
    share with ``prefix`` (a text, or token ids). ``(0, None)`` without a prefix or a cache."""
    if prefix is None or lm.prefix_cache is None or not ids:
        return 0, None
    with lm.lock:
        limit = lm.tokenizer(prefix)["input_ids"] if isinstance(prefix, str) else prefix
        return lm.prefix_cache.states_for(ids, limit, lm.model, lm.device)


def rows_for(
    lm: LanguageModel, longest: int, method: str, new_tokens: int = 0, cached: int = 0
) -> int:
    """Rows per pass for prompts of up to ``longest`` tokens after ``cached`` kept ones:
    ``lm.batch_size`` (``lm.generate_batch_size`` for ``"generate"``, where set), fewer
    where ``lm.memory_budget`` does not hold that many
    (:func:`~dask_pcm.engine.gpu.prompt_bytes`, the key/value states of the kept prefix,
    the prompt and the ``new_tokens`` of ``"generate"`` included)."""
    rows = max(1, int(_batch_size(lm, method)))
    if lm.memory_budget is None:
        return rows
    element = next(lm.model.parameters()).element_size()
    need = prompt_bytes(lm.model.config, element, longest, method, new_tokens, cached)
    return min(rows, rows_that_fit(lm.memory_budget, need))


def in_passes(
    lm: LanguageModel,
    items: list[Any],
    run: Callable[[list[Any]], Any],
    method: str,
    longest: int,
    new_tokens: int = 0,
    cached: int = 0,
    sizes: list[int] | None = None,
) -> list[Any]:
    """``run`` over ``items`` (prompts of up to ``longest`` tokens after ``cached`` kept
    ones) in passes that fit; its results, one per pass. ``sizes``: the items' tokens where
    a pass packs them into sequences of up to :data:`~dask_pcm.engine.prefix.PACK_TOKENS`
    (as :func:`~dask_pcm.engine.prefix.forward` does): a pass then takes as many
    sequences as it would take rows."""
    parts: list[Any] = []
    with lm.lock:
        if sizes is not None:
            longest = max(longest, min(PACK_TOKENS, sum(sizes)))
        rows = rows_for(lm, longest, method, new_tokens, cached)
        done = 0
        while done < len(items):
            take = rows
            if sizes is not None:
                take = sum(len(seq) for seq in pack(sizes[done:], PACK_TOKENS)[:rows])
            chunk = items[done : done + take]
            try:
                parts.append(run(chunk))
                done += len(chunk)
                continue
            except Exception as exc:
                if not is_out_of_memory(exc):
                    raise
                error = f"{type(exc).__name__}: {exc}"
            # Out of the except block: the failed pass's tensors are unreachable now.
            free_cached_memory(sys.modules.get("torch"))
            where = f"{lm.device} ({method}, model {lm.label})"
            rows = halved(len(chunk) if sizes is None else rows, where, error)
            lm.batch_size = min(lm.batch_size, rows)
            if getattr(lm, "generate_batch_size", None):
                lm.generate_batch_size = min(lm.generate_batch_size, rows)
    return parts


def _batch_size(lm: LanguageModel, method: str) -> int:
    """The most rows per pass ``lm`` takes for ``method``."""
    if method == "generate":
        return getattr(lm, "generate_batch_size", None) or lm.batch_size
    return lm.batch_size


def by_length(
    lm: LanguageModel,
    prompts: list[str],
    prefix: str | None,
    run: Callable[[list[list[int]], States | None, int], Any],
    method: str,
    new_tokens: int = 0,
) -> list[Any]:
    """``run(rows, states, start)`` over the prompts' tokens after their kept prefix
    (``start`` tokens whose states are ``states``; see :func:`kept_prefix`), shortest first,
    :func:`in_passes` (packed after a kept prefix for ``"logits"``, where the model allows);
    its results (anything iterable by row), one per row, in the order of ``prompts``."""
    with lm.lock:
        ids = lm.tokenizer(prompts)["input_ids"]
        start, states = kept_prefix(lm, ids, prefix)
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        rows = [ids[i][start:] for i in order]
        packs = method == "logits" and states is not None and packable(lm.model)
        parts = in_passes(
            lm,
            rows,
            lambda chunk: run(chunk, states, start),
            method,
            len(rows[-1]),
            new_tokens,
            start,
            [len(r) for r in rows] if packs else None,
        )
    out: list[Any] = [None] * len(ids)
    for i, value in zip(order, (v for part in parts for v in part), strict=True):
        out[i] = value
    return out
