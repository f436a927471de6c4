"""The task that answers a unit of requests on a worker, whatever their endpoints.

Generation requests with the same parameters run together (:func:`~dask_pcm.apps.llm.
generate`), embeddings all together (:func:`~dask_pcm.apps.llm.embed`). One request that
cannot run (a prompt too long for the model) must not cost the others of its unit their
answers: when a group raises ``ValueError`` its requests run again one by one, and the one
that raises alone gets its error. Any other exception (out of memory, a bug) fails the unit,
which the next run tries again.
"""

from __future__ import annotations

import functools
import json
import re
import time
from collections.abc import Callable
from typing import Any

from dask_pcm.apps import llm
from dask_pcm.exceptions import PromptTooLongError

#: The name of the model's context on the workers.
CONTEXT = "openai-batch-llm"
_ROW_PREFIX = re.compile(r"^row \d+: ")


def answer(rows: list[dict[str, Any]], *, context: str = CONTEXT) -> list[dict[str, Any]]:
    """Answer a unit of requests (rows of :func:`~dask_pcm.apps.openai_batch.input.read_requests`).

    Parameters
    ----------
    rows
        The unit's requests: ``custom_id``, ``endpoint`` and what it needs.
    context
        The language-model context's name.

    Returns
    -------
    list of dict
        Per row: ``created`` (when it ran), ``result`` (JSON text of what the task returned)
        or ``error_code`` and ``error_message``.

    Example
    -------
    >>> answer([{"custom_id": "a", "endpoint": "embedding", "input": ["hi"]}])  # doctest: +SKIP
    [{'created': 1767225600, 'result': '{"embeddings": [[...]], "tokens": 2}', ...}]
    """
    created = int(time.time())
    groups: dict[str, list[int]] = {}
    for i, row in enumerate(rows):
        key = "embedding" if row["endpoint"] == "embedding" else json.dumps(row["params"])
        groups.setdefault(key, []).append(i)
    out: list[dict[str, Any]] = [{} for _ in rows]
    for key, indices in groups.items():
        if key == "embedding":
            run: Callable[..., list[dict[str, Any]]] = _embed
        else:
            run = functools.partial(llm.generate, **json.loads(key))
        for i, result in zip(indices, _each(run, [rows[i] for i in indices], context), strict=True):
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
        code = "context_length_exceeded" if too_long else "invalid_request"
        message = _ROW_PREFIX.sub("", str(exc))
        return [{"result": None, "error_code": code, "error_message": message}]
    return [{"result": json.dumps(r), "error_code": None, "error_message": None} for r in results]


def _embed(rows: list[dict[str, Any]], *, context: str) -> list[dict[str, Any]]:
    flat = [{"text": text} for row in rows for text in row["input"]]
    vectors = iter(llm.embed(flat, context=context))
    out = []
    for row in rows:
        mine = [next(vectors) for _ in row["input"]]
        out.append(
            {"embeddings": [v["embedding"] for v in mine], "tokens": sum(v["tokens"] for v in mine)}
        )
    return out
