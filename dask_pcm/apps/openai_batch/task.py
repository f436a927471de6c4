"""The task that answers a unit of requests on a worker, whatever their endpoints.

Generation requests with the same parameters run together (:func:`~dask_pcm.apps.llm.
generate`): a request's prompts (a list on ``/v1/completions``) times its ``n`` draws are
rows of one call, whose kept prefixes serve every request of the group that shares them.
Embeddings with the same ``dimensions`` run together (:func:`~dask_pcm.apps.llm.embed`).
One request that cannot run (a prompt too long for the model, a schema the decoder cannot
compile) must not cost the others of its unit their answers: when a group raises
``ValueError`` its requests run again one by one, and the one that raises alone gets its
error. Any other exception (out of memory, a bug) fails the unit, which the next run tries
again.
"""

from __future__ import annotations

import functools
import json
import math
import re
import time
from collections.abc import Callable
from typing import Any

from dask_pcm.apps import llm
from dask_pcm.exceptions import PromptTooLongError

#: The name of the model's context on the workers.
CONTEXT = "openai-batch-llm"
#: Where a request's text is, per endpoint: the parameter a too-long prompt is blamed on.
INPUT_PARAM = {"chat": "messages", "completion": "prompt", "responses": "input",
               "embedding": "input"}  # fmt: skip
_ROW_PREFIX = re.compile(r"^row \d+: ")
#: The output columns besides ``custom_id``.
COLUMNS = ("created", "result", "error_code", "error_message", "error_param",
           "prompt_tokens", "completion_tokens", "cached_tokens")  # fmt: skip


def answer(rows: list[dict[str, Any]], *, context: str = CONTEXT) -> list[dict[str, Any]]:
    """Answer a unit of requests (rows of :func:`~dask_pcm.apps.openai_batch.input.read_requests`).

    Parameters
    ----------
    rows
        The unit's requests: ``custom_id``, ``endpoint``, ``params`` and what it needs.
    context
        The language-model context's name.

    Returns
    -------
    list of dict
        Per row: ``created`` (when it ran), ``result`` (JSON text of what the task returned:
        ``choices`` or ``embeddings``) or ``error_code``, ``error_message`` and
        ``error_param``; ``prompt_tokens``, ``completion_tokens`` and ``cached_tokens`` (the
        prompt tokens whose states were reused).

    Example
    -------
    >>> answer([{"custom_id": "a", "endpoint": "embedding", "input": ["hi"],
    ...          "params": "{}"}])  # doctest: +SKIP
    [{'created': 1767225600, 'result': '{"embeddings": [[...]]}', 'prompt_tokens': 2, ...}]
    """
    created = int(time.time())
    groups: dict[tuple[bool, str], list[int]] = {}
    for i, row in enumerate(rows):
        groups.setdefault((row["endpoint"] == "embedding", row["params"]), []).append(i)
    out: list[dict[str, Any]] = [{} for _ in rows]
    for (embedding, params), indices in groups.items():
        task = _embed if embedding else _generate
        run = functools.partial(task, **json.loads(params))
        mine = [rows[i] for i in indices]
        for i, result in zip(indices, _each(run, mine, context), strict=True):
            out[i] = {"created": created, **result}
    return out


def _each(
    run: Callable[..., list[dict[str, Any]]], rows: list[dict[str, Any]], context: str
) -> list[dict[str, Any]]:
    try:
        results = run(rows, context=context)
    except ValueError as exc:
        if len(rows) > 1:
            return [r for row in rows for r in _each(run, [row], context)]
        too_long = isinstance(exc, PromptTooLongError)
        (row,) = rows
        param = INPUT_PARAM[row["endpoint"]] if too_long else getattr(exc, "param", None)
        return [
            {
                "result": None,
                "error_code": "context_length_exceeded" if too_long else "invalid_value",
                "error_message": _ROW_PREFIX.sub("", str(exc)),
                "error_param": param,
                "prompt_tokens": None,
                "completion_tokens": None,
                "cached_tokens": None,
            }
        ]
    return [
        {
            "result": json.dumps(r["result"]),
            "error_code": None,
            "error_message": None,
            "error_param": None,
            "prompt_tokens": r["prompt_tokens"],
            "completion_tokens": r["completion_tokens"],
            "cached_tokens": r["cached_tokens"],
        }
        for r in results
    ]


def _generate(
    rows: list[dict[str, Any]], *, context: str, n: int = 1, json_schema: Any = None, **params: Any
) -> list[dict[str, Any]]:
    """Each request's choices: one per prompt and draw (``index``: prompt * ``n`` + draw)."""
    draws, owner = [], []
    for r, row in enumerate(rows):
        inputs = [{"messages": row["messages"]}] if row.get("messages") is not None else [
            {"prompt": p} for p in row["prompts"]
        ]  # fmt: skip
        for p, given in enumerate(inputs):
            for k in range(n):
                draws.append({**given, "sample": k} if n > 1 else given)
                owner.append((r, p, k))
    try:
        results = llm.generate(draws, context=context, json_schema=json_schema, **params)
    except ValueError as exc:
        if json_schema is not None and not isinstance(exc, PromptTooLongError):
            exc.param = "response_format"  # type: ignore[attr-defined]
        raise
    choices: list[list[dict[str, Any]]] = [[] for _ in rows]
    out: list[dict[str, Any]] = [
        {"result": {"choices": choices[r]}, "prompt_tokens": 0, "completion_tokens": 0,
         "cached_tokens": 0}
        for r in range(len(rows))
    ]  # fmt: skip
    for (r, p, k), result in zip(owner, results, strict=True):
        mine = out[r]
        choice = {key: result.get(key) for key in ("text", "finish_reason", "logprobs")}
        choices[r].append({"index": p * n + k, **choice})
        mine["completion_tokens"] += result["completion_tokens"]
        if k == 0:  # a prompt's tokens count once, however many draws
            mine["prompt_tokens"] += result["prompt_tokens"]
            mine["cached_tokens"] += result.get("cached_tokens", 0)
    return out


def _embed(
    rows: list[dict[str, Any]], *, context: str, dimensions: int | None = None
) -> list[dict[str, Any]]:
    flat = [{"text": text} for row in rows for text in row["input"]]
    vectors = iter(llm.embed(flat, context=context))
    out = []
    for row in rows:
        mine = [next(vectors) for _ in row["input"]]
        embeddings = [_shortened(v["embedding"], dimensions) for v in mine]
        tokens = sum(v["tokens"] for v in mine)
        out.append(
            {"result": {"embeddings": embeddings}, "prompt_tokens": tokens,
             "completion_tokens": 0, "cached_tokens": 0}
        )  # fmt: skip
    return out


def _shortened(vector: list[float], dimensions: int | None) -> list[float]:
    """The first ``dimensions`` values, scaled back to unit length (as OpenAI's
    ``dimensions`` does); ValueError when the model's vectors are shorter."""
    if dimensions is None or dimensions == len(vector):
        return vector
    if dimensions > len(vector):
        error = ValueError(f"dimensions={dimensions}: this model's embeddings have {len(vector)}")
        error.param = "dimensions"  # type: ignore[attr-defined]
        raise error
    head = vector[:dimensions]
    norm = math.sqrt(sum(x * x for x in head)) or 1.0
    return [x / norm for x in head]
