"""Model passes beyond next-token logits, for tasks that need more than
:class:`~dask_pcm.engine.model.LanguageModel` offers: sampling, the log-likelihood of given
continuations, hidden states.

- passes over rows padded on the left with positions that count real tokens only
  (:func:`dask_pcm.engine.prefix.forward`), so a padded row computes what it would alone;
- :func:`decode`: continuations of a batch of prompts, token by token over the model's
  key/value cache, optionally after kept prefix states (every row's prompt continues the
  same cached tokens); each step's token per row chosen by :func:`greedy` or by a
  :func:`sampler`, which draws each row's tokens from its own ``torch.Generator``
  (temperature and nucleus ``top_p``), so that what a row gets depends on its seed and its
  logits alone, never on the draws of the rows around it; :func:`recording` keeps each
  step's log-probabilities (:func:`logprob_entries`: their OpenAI form).
- :func:`completion`: a generated row's result: its text cut at the end-of-sequence token or
  the first stop string (and before a character the token limit cut in half), why it
  ended, its token counts.
- :func:`continuation_start`: where a continuation's tokens begin when tokenized with its
  prompt (the prompt's last token may merge with the continuation's first).
- :func:`continuation_logprobs`: the summed log-probability of each row's tokens from a given
  position on, in one forward pass, optionally after cached prefix states (see
  :mod:`dask_pcm.engine.prefix`).
- :func:`mean_hidden`: the last hidden state averaged over each row's real tokens.

Callers hold the model's lock; every function here runs under ``torch.inference_mode()``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from dask_pcm.engine.prefix import States, cache_argument, forward, left_padded, to_device
from dask_pcm.engine.tokens import token_bytes, whole_characters

#: Chooses each row's next token from its logits (``[rows, vocab]``, float32, CPU).
Pick = Callable[[Any], list[int]]


def eos_ids(model: Any, tokenizer: Any) -> set[int]:
    """Token ids that end a generation: the model's generation config's and the tokenizer's."""
    found: set[int] = set()
    config = getattr(model, "generation_config", None)
    for value in (getattr(config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(value, int):
            found.add(value)
        elif isinstance(value, (list, tuple)):
            found.update(int(v) for v in value)
    return found


def next_token_probs(logits: Any, temperature: float, top_p: float) -> Any:
    """Probabilities to sample the next token from: ``softmax(logits / temperature)``, cut to
    the smallest set of most likely tokens whose mass reaches ``top_p`` and renormalised.

    Example
    -------
    >>> import torch
    >>> next_token_probs(torch.tensor([2.0, 1.0, -5.0]), 1.0, 0.5).tolist()
    [1.0, 0.0, 0.0]
    """
    import torch

    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep a token while the mass before it is still short of top_p (the first always).
        before = sorted_probs.cumsum(-1) - sorted_probs
        sorted_probs[before >= top_p] = 0.0
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum()
    return probs


def greedy(logits: Any) -> list[int]:
    """The most likely token of each row (the first of equals)."""
    return [int(t) for t in logits.argmax(-1).tolist()]


def sampler(generators: Sequence[Any], temperature: float, top_p: float) -> Pick:
    """A :data:`Pick` that draws row ``i``'s token from ``generators[i]`` (a CPU
    ``torch.Generator``) on :func:`next_token_probs`: the same seed gives the same tokens
    wherever the row runs, for the same logits."""
    import torch

    def pick(logits: Any) -> list[int]:
        return [
            int(torch.multinomial(next_token_probs(row, temperature, top_p), 1, generator=g))
            for row, g in zip(logits, generators, strict=True)
        ]

    return pick


#: One step of a row, as :func:`recording` keeps it: the token picked, its log-probability,
#: and the most likely tokens' ids and log-probabilities, most likely first.
Step = tuple[int, float, list[int], list[float]]


def recording(pick: Pick, top: int, steps: Sequence[list[Step]]) -> Pick:
    """A :data:`Pick` that picks as ``pick`` does and appends to ``steps[i]`` row ``i``'s
    :data:`Step`, with its ``top`` most likely tokens: log-probabilities of the logits as
    the model gave them (``log_softmax``, before a temperature, a nucleus or a mask changes
    what is drawn from), float32.

    :func:`decode` picks for every row at every step, finished rows included, so row
    ``i``'s ``j``-th token is its ``j``-th step's: its first ``len(tokens)`` steps are its
    own.
    """
    import torch

    def pick_recorded(logits: Any) -> list[int]:
        logprobs = torch.log_softmax(logits, dim=-1)
        chosen = pick(logits)
        picked = logprobs[torch.arange(len(chosen)), torch.tensor(chosen)].tolist()
        values, ids = logprobs.topk(min(top, logprobs.shape[-1]), dim=-1)
        for row, token, logprob, top_ids, top_values in zip(
            steps, chosen, picked, ids.tolist(), values.tolist(), strict=True
        ):
            row.append((token, logprob, top_ids, top_values))
        return chosen

    return pick_recorded


def logprob_entries(tokenizer: Any, steps: Sequence[Step]) -> list[dict[str, Any]]:
    """The OpenAI form of a row's ``steps``: per token ``token`` (its text), ``logprob``,
    ``bytes`` (the UTF-8 bytes it holds, :func:`~dask_pcm.engine.tokens.token_bytes`: half
    a character's where it holds half of one) and ``top_logprobs``, a list of such dicts
    (without their own ``top_logprobs``), most likely first."""
    ids = sorted({t for token, _, top, _ in steps for t in (token, *top)})
    texts = {t: tokenizer.decode([t]) for t in ids}
    raw = dict(zip(ids, token_bytes(tokenizer, ids), strict=True))

    def entry(token: int, logprob: float) -> dict[str, Any]:
        return {"token": texts[token], "logprob": logprob, "bytes": list(raw[token])}

    return [
        {
            **entry(token, logprob),
            "top_logprobs": [entry(*t) for t in zip(top, values, strict=True)],
        }
        for token, logprob, top, values in steps
    ]


def decode(
    model: Any,
    rows: Sequence[Sequence[int]],
    pad_id: int,
    device: str,
    *,
    max_tokens: int,
    eos: set[int],
    pick: Pick = greedy,
    prefix: States | None = None,
    prefix_len: int = 0,
    stopped: Callable[[list[int]], bool] | None = None,
) -> list[list[int]]:
    """The tokens generated after each row (token ids after ``prefix_len`` cached tokens
    whose states are ``prefix``), up to ``max_tokens``, an ``eos`` token (kept) or the
    first token after which ``stopped(tokens)`` is true.

    One pass over the rows padded on the left (from views of the kept states, so the
    prefix is never run again), then one pass per token over the growing key/value cache.
    A row's positions count its real tokens only, so it continues as it would alone; a
    finished row is fed padding until every row has finished.
    """
    import torch
    from transformers import DynamicCache

    lengths = [len(r) for r in rows]
    input_ids, mask, positions = left_padded(rows, pad_id, prefix_len)
    batch = len(rows)
    if prefix is None:
        cache = DynamicCache(config=model.config)
    else:
        # The first pass appends to a copy (torch.cat), never to the kept states.
        views = [(k.expand(batch, -1, -1, -1), v.expand(batch, -1, -1, -1)) for k, v in prefix]
        cache = DynamicCache(ddp_cache_data=views, config=model.config)
    tokens: list[list[int]] = [[] for _ in rows]
    done = [False] * batch
    # The prompt's last column by index: the head gets a contiguous copy (see forward).
    keep: Any = torch.tensor([input_ids.shape[1] - 1])
    argument = cache_argument(model)
    mask = to_device(mask, device)
    with torch.inference_mode():
        for step in range(max_tokens):
            out = model(
                input_ids=to_device(input_ids, device),
                attention_mask=mask,
                position_ids=to_device(positions, device),
                use_cache=True,
                logits_to_keep=to_device(keep, device),
                **{argument: cache},
            )
            cache = out.cache if hasattr(out, "cache") else out.past_key_values
            chosen = pick(out.logits[:, -1, :].float().cpu())
            for i, token in enumerate(chosen):
                if done[i]:
                    continue
                tokens[i].append(token)
                done[i] = token in eos or (stopped is not None and stopped(tokens[i]))
            if all(done) or step + 1 == max_tokens:
                break
            fed = [pad_id if done[i] else tokens[i][-1] for i in range(batch)]
            input_ids = torch.tensor(fed, dtype=torch.long)[:, None]
            positions = torch.tensor([prefix_len + n + step for n in lengths])[:, None]
            mask = torch.cat([mask, mask.new_ones((batch, 1))], dim=1)
            keep = torch.tensor([0])
    return tokens


def stop_position(tokenizer: Any, tokens: Sequence[int], stops: Sequence[str]) -> int:
    """Where in the decoded ``tokens`` the first of ``stops`` begins; -1 if none does."""
    text = tokenizer.decode(list(tokens), skip_special_tokens=True)
    found = [p for p in (text.find(s) for s in stops) if p >= 0]
    return min(found, default=-1)


def completion(
    tokenizer: Any, tokens: list[int], eos: set[int], stops: Sequence[str], prompt_tokens: int
) -> dict[str, Any]:
    """One row's result from its generated ``tokens``: ``text`` cut at the end-of-sequence
    token, then before the first stop string; ``finish_reason`` ``"stop"`` where either ended
    it, else ``"length"``; ``prompt_tokens``; ``completion_tokens``, those generated until it
    ended (the end-of-sequence token, or the one that completed the stop string, included).
    A text that the token limit cut in the middle of a multi-byte character ends before it
    (:func:`~dask_pcm.engine.tokens.whole_characters`); a U+FFFD the tokens hold whole stays.

    Example
    -------
    >>> tokens = tokenizer("Paris 🍕", add_special_tokens=False)["input_ids"]  # doctest: +SKIP
    >>> completion(tokenizer, tokens[:-1], {2}, [], 3)["text"]  # doctest: +SKIP
    'Paris '
    """
    reason = "length"
    end = next((k for k, t in enumerate(tokens) if t in eos), None)
    if end is not None:
        tokens, reason = tokens[: end + 1], "stop"
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    if reason == "length" and text.endswith("\ufffd"):
        # Cut in the middle of a character: its first bytes stay out of the text (as a
        # streaming detokenizer holds them back), still counted as generated.
        whole = whole_characters(token_bytes(tokenizer, tokens))
        if whole < len(tokens):
            text = tokenizer.decode(tokens[:whole], skip_special_tokens=True)
    at = stop_position(tokenizer, tokens, stops) if stops else -1
    if at >= 0:
        text, reason = text[:at], "stop"
        low, high = 1, len(tokens)  # the fewest leading tokens whose text holds a stop string
        while low < high:
            mid = (low + high) // 2
            if stop_position(tokenizer, tokens[:mid], stops) >= 0:
                high = mid
            else:
                low = mid + 1
        tokens = tokens[:low]
    return {
        "text": text,
        "finish_reason": reason,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(tokens),
    }


def continuation_start(prompt_ids: Sequence[int], full: Sequence[int]) -> int:
    """Where a continuation's tokens begin in ``full`` (prompt and continuation tokenized
    together): after the tokens ``full`` shares with the prompt alone (a prompt token that
    merged with the continuation's first characters counts as the continuation's), and never
    at index 0, which nothing predicts.

    Example
    -------
    >>> continuation_start([1, 7, 8], [1, 7, 8, 9]), continuation_start([1, 7, 8], [1, 7, 5])
    (3, 2)
    """
    n = 0
    for a, b in zip(prompt_ids, full, strict=False):
        if a != b:
            break
        n += 1
    return max(1, n)


def continuation_logprobs(
    model: Any,
    rows: Sequence[Sequence[int]],
    starts: Sequence[int],
    pad_id: int,
    device: str,
    prefix: States | None = None,
    prefix_len: int = 0,
) -> list[float]:
    """For each row (token ids after ``prefix_len`` cached tokens), the summed log-probability
    of its tokens from index ``starts[i]`` on (at least 1: a row's first token has no
    prediction here), in one forward pass. Only the last positions' logits are computed."""
    import torch

    keep = max(len(r) - s for r, s in zip(rows, starts, strict=True)) + 1
    width = max(len(r) for r in rows)
    logits = forward(model, rows, pad_id, device, prefix, prefix_len, keep)
    with torch.inference_mode():
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        sums = []
        for i, (row, start) in enumerate(zip(rows, starts, strict=True)):
            n = len(row)
            if start >= n:
                sums.append(0.0)
                continue
            # Row i's token j sits at column width - n + j and is predicted one column before;
            # the kept logits begin at column width - keep.
            columns = torch.arange(width - n + start - 1, width - 1) - (width - keep)
            targets = torch.tensor(list(row[start:]), dtype=torch.long)
            picked = logprobs[i, to_device(columns, device), to_device(targets, device)]
            sums.append(float(picked.sum().item()))
    return sums


def mean_hidden(model: Any, rows: Sequence[Sequence[int]], pad_id: int, device: str) -> Any:
    """The last hidden state (after the final norm) averaged over each row's tokens, padding
    left out: float32 on the CPU, ``[len(rows), hidden_size]``."""
    import torch

    input_ids, mask, positions = left_padded(rows, pad_id)
    inputs = {
        "input_ids": to_device(input_ids, device),
        "attention_mask": to_device(mask, device),
        "position_ids": to_device(positions, device),
    }
    base = getattr(model, "base_model", None)
    with torch.inference_mode():
        if base is not None and base is not model:
            # The bare transformer: no language-model head over every position.
            hidden = base(**inputs, use_cache=False).last_hidden_state
        else:
            out = model(**inputs, use_cache=False, output_hidden_states=True, logits_to_keep=1)
            hidden = out.hidden_states[-1]
        weights = inputs["attention_mask"].unsqueeze(-1).to(torch.float32)
        summed = (hidden.float() * weights).sum(dim=1)
        return (summed / weights.sum(dim=1).clamp(min=1.0)).cpu()
