"""Built-in task functions for the batch layer: text generation, choice scoring, embeddings.

Each follows the batch layer's contract, ``fn(rows, **kwargs) -> list[dict]``: ``rows`` are
one unit's rows (dicts of the input's columns) and the result has one dict per row, in order.
They run against a language-model context resident on the worker (``context``, its name;
a :class:`~dask_pcm.LanguageModel` itself also works, for local use). A row that cannot run
(no prompt, a prompt too long for the model's context or for one pass in memory) raises, and
the batch layer records the unit's error.

- :func:`generate`: greedy (batched) or sampled continuations of prompts or chat messages.
- :func:`score_choices`: the log-likelihood of each of a row's choices after its prompt.
- :func:`embed`: mean-pooled last hidden states.
"""

from __future__ import annotations

import hashlib
import math
import numbers
import secrets
from collections.abc import Sequence
from typing import Any

from dask_pcm.engine.constraint import constrained, json_matchers
from dask_pcm.engine.generation import (
    Pick,
    Step,
    completion,
    continuation_logprobs,
    continuation_start,
    decode,
    eos_ids,
    greedy,
    logprob_entries,
    mean_hidden,
    recording,
    sampler,
    stop_position,
)
from dask_pcm.engine.model import LanguageModel, prompt_problem
from dask_pcm.engine.passes import in_passes, kept_prefix, prefix_groups
from dask_pcm.engine.prefix import packable
from dask_pcm.engine.vllm import VLLMModel, is_vllm
from dask_pcm.exceptions import PromptTooLongError
from dask_pcm.tasks import get_context


def generate(
    rows: list[dict[str, Any]],
    *,
    context: str | LanguageModel = "llm",
    prompt: str = "prompt",
    messages: str = "messages",
    max_tokens: int = 16,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop: str | Sequence[str] | None = None,
    logprobs: int | None = None,
    json_schema: dict[str, Any] | None = None,
    sample: str = "sample",
) -> list[dict[str, Any]]:
    """Continue each row's prompt (or chat).

    Rows run in passes that fit the device, as :meth:`dask_pcm.LanguageModel.generate`;
    tokens the unit's prompts all start with run once and are kept, where the model keeps
    prefixes (``prefix_cache``). At ``temperature == 0`` decoding is greedy. Otherwise each
    row's tokens are drawn from its own generator, seeded by ``seed`` and the row's prompt
    text (and its sample number): the same text whatever unit or pass the row lands in,
    prefix kept or not (its logits change by float rounding only, which moves no draw but
    one within rounding of the boundary between two tokens). With ``json_schema`` every
    token is picked among those the schema's grammar allows next
    (:mod:`dask_pcm.engine.constraint`), and a row ends once its JSON is complete.

    Parameters
    ----------
    rows
        The unit's rows.
    context
        The language-model context's name (or a LanguageModel).
    prompt, messages
        Columns holding a prompt string, or a chat: a list of ``{"role", "content"}`` dicts,
        rendered by the tokenizer's chat template with the assistant's turn opened
        (``role: content`` lines and ``assistant:`` without a template). A row's messages,
        when present and not None, take precedence.
    max_tokens
        Most tokens generated per row.
    temperature, top_p
        Sampling temperature (0: greedy) and nucleus mass.
    seed
        Seed of the sampling; ``None``: a fresh one per call.
    stop
        A string or strings: the text ends before the first one found.
    logprobs
        ``None``: none. An int ``k`` from 0 to 20: each row's result has ``logprobs``, the
        log-probability of each token generated and of the ``k`` most likely ones at its
        step, from the model's logits before temperature, nucleus or schema.
    json_schema
        A JSON Schema that every text is to be valid against (``{"type": "object"}``: any
        JSON object); JSON is written without whitespace unless the schema's
        ``"x-guidance"`` options allow it. ValueError where it cannot be compiled.
    sample
        A column holding a row's sample number (an int; several draws of one prompt): when
        present, it goes into the row's seed, so that each sample draws its own text.

    Returns
    -------
    list of dict
        Per row: ``text``, ``finish_reason`` (``"stop"``: a stop string or the end-of-sequence
        token ended it, or its JSON was complete; ``"length"``: ``max_tokens`` did),
        ``prompt_tokens``, ``completion_tokens`` (generated until it stopped; a character
        the limit cut in half is counted, but left out of ``text``) and ``cached_tokens``
        (its prompt's leading tokens whose states came from the kept prefix: those the
        unit's prompts share, where the model keeps prefixes; 0 where none). With
        ``logprobs``: ``logprobs``, one dict per token counted in ``completion_tokens``
        but a final end-of-sequence token, as OpenAI's chat completions give them:
        ``token``, ``logprob``, ``bytes`` (the UTF-8 bytes it holds) and ``top_logprobs``
        (``k`` such dicts, most likely first).

    Example
    -------
    >>> generate([{"prompt": "The capital of France is"}], max_tokens=4, stop=".")  # doctest: +SKIP
    [{'text': ' Paris', 'finish_reason': 'stop', 'prompt_tokens': 6, 'completion_tokens': 2, 'cached_tokens': 0}]
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
    if logprobs is not None and (
        isinstance(logprobs, bool) or not isinstance(logprobs, int) or not 0 <= logprobs <= 20
    ):
        raise ValueError(f"logprobs must be None or an int from 0 to 20, got {logprobs!r}")
    stops = [s for s in ([stop] if isinstance(stop, str) else stop or ()) if s]
    lm = _model(context)
    texts, chats = _prompts(lm, rows, prompt, messages)
    draws = [_sample_of(row, i, sample) for i, row in enumerate(rows)]
    seeds = None
    if temperature > 0:
        base = secrets.randbits(63) if seed is None else seed
        seeds = [_row_seed(base, t, n) for t, n in zip(texts, draws, strict=True)]
    if is_vllm(lm):
        sampling = {"temperature": temperature, "top_p": top_p, "seeds": seeds}
        return _vllm_generate(lm, texts, chats, max_tokens, sampling, stops, logprobs, json_schema)
    import torch

    with lm.lock, torch.inference_mode():
        ids = _encode(lm, texts, chats)
        _check(lm, [len(seq) for seq in ids], "generate", max_tokens)
        eos = eos_ids(lm.model, lm.tokenizer)
        found = None if not stops else (lambda t: stop_position(lm.tokenizer, t, stops) >= 0)
        matchers = None
        if json_schema is not None:
            matchers = json_matchers(lm.tokenizer, eos, json_schema, len(ids))
        steps: list[list[Step]] = [[] for _ in ids]
        choose = _chooser(seeds, (temperature, top_p), matchers, eos, logprobs, steps)
        generated, cached = _decoded(lm, ids, max_tokens, eos, found, choose)
        results = []
        for tokens, row_ids, row_steps, cached_tokens in zip(
            generated, ids, steps, cached, strict=True
        ):
            result = completion(lm.tokenizer, tokens, eos, stops, len(row_ids))
            result["cached_tokens"] = cached_tokens
            if logprobs is not None:
                counted = tokens[: result["completion_tokens"]]
                kept = len(counted) - bool(counted and counted[-1] in eos)
                result["logprobs"] = logprob_entries(lm.tokenizer, row_steps[:kept])
            results.append(result)
        return results


def score_choices(
    rows: list[dict[str, Any]],
    *,
    context: str | LanguageModel = "llm",
    prompt: str = "prompt",
    messages: str = "messages",
    choices: str | Sequence[str] = "choices",
) -> list[dict[str, Any]]:
    """Score each row's choices by their log-likelihood after its prompt.

    A choice's score is the sum of the log-probabilities of its tokens, prompt and choice
    tokenized together: where the prompt's last token merges with the choice's first, the
    merged token counts as the choice's. Prompt-choice pairs share forward passes; when every
    pair of the unit starts with the same tokens (a template's instructions, or one prompt's
    choices) and the model keeps prefixes (``prefix_cache``), those run once and are kept.

    Parameters
    ----------
    rows
        The unit's rows.
    context
        The language-model context's name (or a LanguageModel).
    prompt, messages
        As for :func:`generate`.
    choices
        A column name (a string), whose value in each row is its list of choices; or the
        choices themselves (a list of strings), the same for every row.

    Returns
    -------
    list of dict
        Per row: ``scores`` (one float per choice, in order), ``best`` (the choice with the
        highest score) and ``best_index``.

    Example
    -------
    >>> score_choices([{"prompt": "Water is"}], choices=[" wet", " dry"])  # doctest: +SKIP
    [{'scores': [-3.1, -7.4], 'best': ' wet', 'best_index': 0}]
    """
    lm = _model(context)
    texts, chats = _prompts(lm, rows, prompt, messages)
    options = [_choices_of(row, i, choices) for i, row in enumerate(rows)]
    pairs = [(i, t + c) for i, (t, cs) in enumerate(zip(texts, options, strict=True)) for c in cs]
    import torch

    with lm.lock, torch.inference_mode():
        prompt_ids = _encode(lm, texts, chats)
        full = _encode(lm, [text for _, text in pairs], [chats[i] for i, _ in pairs])
        longest = [0] * len(rows)
        for (i, _), seq in zip(pairs, full, strict=True):
            longest[i] = max(longest[i], len(seq))
        _check(lm, longest, "logits", 0)
        starts = [
            continuation_start(prompt_ids[i], seq) for (i, _), seq in zip(pairs, full, strict=True)
        ]
    if is_vllm(lm):
        flat = lm.continuation_logprobs(full, starts)
    else:
        with lm.lock, torch.inference_mode():
            flat = _continuations(lm, full, starts)
    results, done = [], 0
    for cs in options:
        scores = flat[done : done + len(cs)]
        done += len(cs)
        best = max(range(len(cs)), key=scores.__getitem__)
        results.append({"scores": scores, "best": cs[best], "best_index": best})
    return results


def embed(
    rows: list[dict[str, Any]],
    *,
    context: str | LanguageModel = "llm",
    text: str = "text",
    normalize: bool = True,
) -> list[dict[str, Any]]:
    """Embed each row's text: the model's last hidden state averaged over its tokens.

    Parameters
    ----------
    rows
        The unit's rows.
    context
        The context's name (or the object itself): a language model
        (:class:`~dask_pcm.LanguageModel`), whose last hidden states are averaged, or any
        encoder with a ``sentence-transformers`` style ``encode(texts,
        normalize_embeddings=...)`` (a ``SentenceTransformer``), whose own pooling is used.
    text
        The column holding the text.
    normalize
        Scale each embedding to unit (L2) length.

    Returns
    -------
    list of dict
        Per row: ``embedding`` (``hidden_size`` floats) and ``tokens`` (its token count).

    Example
    -------
    >>> embed([{"text": "Paris is the capital of France."}])[0]["tokens"]  # doctest: +SKIP
    8
    """
    held = get_context(context) if isinstance(context, str) else context
    texts = []
    for i, row in enumerate(rows):
        value = row.get(text)
        if not isinstance(value, str):
            raise ValueError(f"row {i}: column {text!r} holds no string (got {value!r:.80})")
        texts.append(value)
    if is_vllm(held):
        ids = held.encode(texts)
        held.too_long([len(seq) for seq in ids], 0)
        vectors = held.embed_ids(ids)
    elif not isinstance(held, LanguageModel) and callable(getattr(held, "encode", None)):
        return _encoded(held, texts, normalize)
    else:
        vectors, ids = _embedded(held, texts)
    import torch

    if not vectors:
        return []
    matrix = torch.stack(vectors)
    if normalize:
        matrix = torch.nn.functional.normalize(matrix, dim=-1)
    return [
        {"embedding": [float(x) for x in v], "tokens": len(seq)}
        for v, seq in zip(matrix.tolist(), ids, strict=True)
    ]


def _embedded(lm: LanguageModel, texts: list[str]) -> tuple[list[Any], list[list[int]]]:
    """Mean-pooled last hidden states of ``texts`` on the Hugging Face engine, and their ids."""
    import torch

    with lm.lock, torch.inference_mode():
        ids = lm.tokenizer(texts)["input_ids"] if texts else []
        _check(lm, [len(seq) for seq in ids], "logits", 0)
        pad = int(lm.tokenizer.pad_token_id)

        def run(chunk: list[tuple[int, list[int]]]) -> list[tuple[int, Any]]:
            vectors = mean_hidden(lm.model, [seq for _, seq in chunk], pad, lm.device)
            return list(zip([i for i, _ in chunk], vectors, strict=True))

        return _in_passes(lm, ids, run, "logits"), ids


def _vllm_generate(
    lm: VLLMModel,
    texts: list[str],
    chats: list[bool],
    max_tokens: int,
    sampling: dict[str, Any],
    stops: list[str],
    logprobs: int | None,
    json_schema: dict[str, Any] | None,
) -> list[dict[str, Any]]:
    """:func:`generate` on a vLLM context: the same prompts' token ids, vLLM's decoding."""
    ids = _encode(lm, texts, chats)
    lm.too_long([len(seq) for seq in ids], max_tokens)
    rows = lm.sample(
        ids, max_tokens=max_tokens, stops=stops, logprobs=logprobs, json_schema=json_schema,
        **sampling,
    )  # fmt: skip
    results = []
    for row, seq in zip(rows, ids, strict=True):
        result = {
            "text": row["text"],
            "finish_reason": row["finish_reason"],
            "prompt_tokens": len(seq),
            "completion_tokens": len(row["tokens"]),
            "cached_tokens": row["cached_tokens"],
        }
        if logprobs is not None:
            result["logprobs"] = logprob_entries(lm.tokenizer, row["steps"])
        results.append(result)
    return results


def _encoded(encoder: Any, texts: list[str], normalize: bool) -> list[dict[str, Any]]:
    """:func:`embed` through an encoder's own ``encode`` (a sentence-transformers model)."""
    if not texts:
        return []
    vectors = encoder.encode(texts, normalize_embeddings=normalize, convert_to_numpy=True)
    tokenizer = getattr(encoder, "tokenizer", None)
    counts = [len(x) for x in tokenizer(texts)["input_ids"]] if tokenizer else [None] * len(texts)
    return [
        {"embedding": [float(x) for x in v], "tokens": n}
        for v, n in zip(vectors.tolist(), counts, strict=True)
    ]


def _model(context: str | LanguageModel) -> Any:
    """The context's built model: a LanguageModel, or a vLLM engine (:class:`VLLMModel`)."""
    return get_context(context) if isinstance(context, str) else context


def _prompts(
    lm: LanguageModel, rows: list[dict[str, Any]], prompt: str, messages: str
) -> tuple[list[str], list[bool]]:
    """Each row's prompt text (its chat rendered), and whether it was a chat; ValueError
    naming the first row that has neither."""
    texts, chats = [], []
    for i, row in enumerate(rows):
        chat = row.get(messages)
        if chat is not None and not isinstance(chat, float):  # NaN: a missing value in pandas
            texts.append(_render(lm, chat, f"row {i}: {messages!r}"))
            # Without a chat template the fallback lines are a plain prompt.
            chats.append(bool(getattr(lm.tokenizer, "chat_template", None)))
            continue
        text = row.get(prompt)
        if not isinstance(text, str):
            raise ValueError(f"row {i}: no prompt string in {prompt!r} nor chat in {messages!r}")
        texts.append(text)
        chats.append(False)
    return texts, chats


def _render(lm: LanguageModel, chat: Any, where: str) -> str:
    turns = list(chat)  # a list, or an array of dicts as Parquet reads it back
    if not all(isinstance(t, dict) and "role" in t and "content" in t for t in turns):
        raise ValueError(f"{where} is not a list of {{'role', 'content'}} dicts")
    if getattr(lm.tokenizer, "chat_template", None):
        with lm.lock:
            text = lm.tokenizer.apply_chat_template(
                turns, tokenize=False, add_generation_prompt=True
            )
        return str(text)
    return "".join(f"{t['role']}: {t['content']}\n" for t in turns) + "assistant:"


def _encode(lm: LanguageModel | VLLMModel, texts: list[str], chats: list[bool]) -> list[list[int]]:
    """Token ids of ``texts``: a prompt with the special tokens its tokenizer adds, a rendered
    chat as its template wrote it (the template writes its own special tokens, as
    transformers' and vLLM's chat paths tokenize it)."""
    ids: list[list[int]] = [[] for _ in texts]
    for chat in (False, True):
        index = [i for i, c in enumerate(chats) if c is chat]
        if index:
            encoded = lm.tokenizer([texts[i] for i in index], add_special_tokens=not chat)
            for i, seq in zip(index, encoded["input_ids"], strict=True):
                ids[i] = list(seq)
    return ids


def _check(lm: LanguageModel, lengths: list[int], method: str, new_tokens: int) -> None:
    """PromptTooLongError (a ValueError) naming the first row whose tokens cannot run."""
    for i, tokens in enumerate(lengths):
        problem = prompt_problem(lm, tokens, method, new_tokens)
        if problem:
            raise PromptTooLongError(
                f"row {i}: the prompt cannot run on model {lm.label}: {problem}"
            )


def _in_passes(
    lm: LanguageModel,
    ids: list[list[int]],
    run: Any,
    method: str,
    new_tokens: int = 0,
    cached: int = 0,
    packed: bool = False,
) -> list[Any]:
    """``run`` over ``(index, ids)`` pairs, shortest first, in passes that fit (the model's own
    pass sizing and out-of-memory halving; by their tokens where ``packed``); the results
    back in row order."""
    if not ids:
        return []
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    items = [(i, ids[i]) for i in order]
    sizes = [len(seq) for _, seq in items] if packed else None
    parts = in_passes(lm, items, run, method, len(items[-1][1]), new_tokens, cached, sizes)
    out: list[Any] = [None] * len(ids)
    for part in parts:
        for i, value in part:
            out[i] = value
    return out


def _chooser(
    seeds: list[int] | None,
    sampling: tuple[float, float],
    matchers: list[Any] | None,
    eos: set[int],
    logprobs: int | None,
    steps: list[list[Step]],
) -> Any:
    """``choose(row indices of a pass)``: the pass's Pick. Greedy, or drawn from generators
    seeded by ``seeds`` at ``sampling`` (temperature, top_p); among the tokens ``matchers``
    allow, where given; its log-probabilities recorded in ``steps`` where ``logprobs`` asks.
    Each pass starts its rows' generators, matchers and steps from their start: a pass that
    ran out of memory runs again, smaller, from its first token."""
    import torch

    def choose(index: list[int]) -> Any:
        pick: Pick = greedy
        if seeds is not None:
            gens = [torch.Generator().manual_seed(seeds[i]) for i in index]
            pick = sampler(gens, *sampling)
        if matchers is not None:
            for i in index:
                matchers[i].reset()
            pick = constrained(pick, [matchers[i] for i in index], eos)
        if logprobs is not None:
            for i in index:
                steps[i].clear()
            pick = recording(pick, logprobs, [steps[i] for i in index])
        return pick

    return choose


def _decoded(
    lm: LanguageModel,
    ids: list[list[int]],
    max_tokens: int,
    eos: set[int],
    stopped: Any,
    choose: Any,
) -> tuple[list[list[int]], list[int]]:
    """Each row's generated tokens, picked by ``choose(row indices of a pass)``, and how
    many of its leading prompt tokens it ran after from kept states: per group of rows
    that begin alike (:func:`~dask_pcm.engine.passes.prefix_groups`), the tokens the group
    shares, kept where it has two rows or more (one prompt alone would only fill the
    cache)."""
    generated: list[list[int]] = [[] for _ in ids]
    cached = [0] * len(ids)
    for group in _groups(lm, ids):
        tokens, shared = _group_decoded(lm, ids, group, max_tokens, eos, stopped, choose)
        for i, row_tokens in zip(group, tokens, strict=True):
            generated[i], cached[i] = row_tokens, shared
    return generated, cached


def _group_decoded(
    lm: LanguageModel,
    ids: list[list[int]],
    group: list[int],
    max_tokens: int,
    eos: set[int],
    stopped: Any,
    choose: Any,
) -> tuple[list[list[int]], int]:
    """:func:`_decoded` of the rows ``group`` of ``ids``, after the tokens they share."""
    mine = [ids[i] for i in group]
    shared, states = kept_prefix(lm, mine, mine[0]) if len(mine) > 1 else (0, None)
    pad = int(lm.tokenizer.pad_token_id)

    def run(chunk: list[tuple[int, list[int]]]) -> list[tuple[int, list[int]]]:
        tokens = decode(
            lm.model, [seq for _, seq in chunk], pad, lm.device, max_tokens=max_tokens,
            eos=eos, pick=choose([group[i] for i, _ in chunk]), prefix=states,
            prefix_len=shared, stopped=stopped,
        )  # fmt: skip
        return list(zip([i for i, _ in chunk], tokens, strict=True))

    rest = [seq[shared:] for seq in mine]
    return _in_passes(lm, rest, run, "generate", max_tokens, shared), shared


def _continuations(lm: LanguageModel, seqs: list[list[int]], starts: list[int]) -> list[float]:
    """The summed log-probability of each sequence's tokens from its start on; per group of
    sequences that begin alike (:func:`~dask_pcm.engine.passes.prefix_groups`), after the
    tokens the group shares, kept."""
    sums = [0.0] * len(seqs)
    for group in _groups(lm, seqs):
        values = _group_continuations(lm, [seqs[i] for i in group], [starts[i] for i in group])
        for i, value in zip(group, values, strict=True):
            sums[i] = value
    return sums


def _group_continuations(
    lm: LanguageModel, seqs: list[list[int]], starts: list[int]
) -> list[float]:
    """:func:`_continuations` of sequences that run after the tokens they share."""
    # At most up to the token before the earliest choice: its logits are needed.
    shared, states = kept_prefix(lm, seqs, seqs[0][: min(starts) - 1])
    pad = int(lm.tokenizer.pad_token_id)

    def run(chunk: list[tuple[int, list[int]]]) -> list[tuple[int, float]]:
        rows = [seq for _, seq in chunk]
        firsts = [starts[i] - shared for i, _ in chunk]
        sums = continuation_logprobs(lm.model, rows, firsts, pad, lm.device, states, shared)
        return list(zip([i for i, _ in chunk], sums, strict=True))

    packed = states is not None and packable(lm.model)  # as continuation_logprobs runs them
    rest = [seq[shared:] for seq in seqs]
    return _in_passes(lm, rest, run, "logits", cached=shared, packed=packed)


def _groups(lm: LanguageModel, ids: list[list[int]]) -> list[list[int]]:
    """The groups of rows that run after prefix states of their own (all rows in one where
    the model keeps no prefixes); none for no rows."""
    if not ids:
        return []
    return prefix_groups(ids) if lm.prefix_cache is not None else [list(range(len(ids)))]


def _choices_of(row: dict[str, Any], i: int, choices: str | Sequence[str]) -> list[str]:
    options = row.get(choices) if isinstance(choices, str) else choices
    options = None if options is None else list(options)
    if not options or not all(isinstance(c, str) for c in options):
        where = f"column {choices!r}" if isinstance(choices, str) else "choices"
        raise ValueError(f"row {i}: {where} is not a non-empty list of strings")
    return options


def _sample_of(row: dict[str, Any], i: int, column: str) -> int | None:
    """A row's sample number: ``None`` where the column is missing or empty (None, NaN)."""
    value = row.get(column)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"row {i}: column {column!r} holds no sample number (got {value!r:.80})")
    return int(value)


def _row_seed(seed: int, text: str, sample: int | None = None) -> int:
    """A row's sampling seed: from ``seed``, its prompt text and its sample number (where it
    has one), not from where it runs."""
    key = f"{seed}\0{text}" if sample is None else f"{seed}\0{text}\0{sample}"
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1
