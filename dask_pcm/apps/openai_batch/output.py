"""What a run of an OpenAI Batch API file writes: ``output.jsonl`` and ``errors.jsonl``.

Both are written again at the end of every run (a resume too) from the output folder's rows
and the input's refused requests, in input order, each whole or not at all, under the
folder's lock. Every id is stable: derived from the model's name and the ``custom_id``.

As OpenAI writes them: an answered request is a 200 ``response`` whose ``body`` is a
``ChatCompletion``, ``Completion``, ``Response`` or ``CreateEmbeddingResponse``; a request
that ran and failed (refused, too long, a worker lost with it) is a 4xx or 5xx ``response``
whose body is ``{"error": {"message", "type", "param", "code"}}``; the top-level ``error``
is kept for requests that did not run (``batch_expired``: the completion window ended
first; ``batch_cancelled``: the run stopped first).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import logging
import os
import socket
import struct
import tempfile
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from dask_pcm import locks
from dask_pcm.apps.openai_batch.input import Refusal, Request, Requests
from dask_pcm.apps.openai_batch.task import COLUMNS as TASK_COLUMNS
from dask_pcm.batch.files import LOCK, atomic_file
from dask_pcm.batch.run import BatchResult
from dask_pcm.batch.segments import iter_predictions
from dask_pcm.exceptions import OutputFolderError

OUTPUT, ERRORS = "output.jsonl", "errors.jsonl"
#: The columns of the output folder that the files are made from.
COLUMNS = ["custom_id", *TASK_COLUMNS, "error"]
#: The HTTP status of each error code a request can get here (400 for the others).
STATUS = {"model_not_found": 404, "server_error": 500}


def key_of(model: str, custom_id: str) -> str:
    """The stable part of a request's ids: from the model's name and its ``custom_id``."""
    return hashlib.sha256(f"{model}\0{custom_id}".encode()).hexdigest()[:24]


def body(
    request: Request, result: dict[str, Any], usage: dict[str, int], model: str, created: int
) -> dict[str, Any]:
    """The response body the OpenAI API would give for ``result``, what the task returned for
    ``request`` (:func:`~dask_pcm.apps.openai_batch.task.answer`), with its token counts
    ``usage`` (``prompt_tokens``, ``completion_tokens``, ``cached_tokens``)."""
    row = request.row or {}
    endpoint, key = row["endpoint"], key_of(model, request.custom_id)
    if endpoint == "embedding":
        return _embeddings(result["embeddings"], row.get("encoding", "float"), model, usage)
    params = json.loads(row["params"])
    if endpoint == "responses":
        return _response(result["choices"][0], params, row, model, created, key, usage)
    chat = endpoint == "chat"
    choices = []
    for choice in sorted(result["choices"], key=lambda c: c["index"]):
        out: dict[str, Any] = {"index": choice["index"], "finish_reason": choice["finish_reason"]}
        tokens = choice.get("logprobs")
        if chat:
            out["message"] = {"role": "assistant", "content": choice["text"], "refusal": None,
                              "annotations": []}  # fmt: skip
            out["logprobs"] = None if tokens is None else {"content": tokens, "refusal": None}
        else:
            out["text"] = choice["text"]
            prompts = row["prompts"]
            prompt = prompts[choice["index"] // params.get("n", 1)]
            out["logprobs"] = None if tokens is None else _legacy_logprobs(tokens, len(prompt))
        choices.append(out)
    prompt, completion = usage["prompt_tokens"], usage["completion_tokens"]
    return {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{key}",
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": usage["cached_tokens"]},
        },
    }


def _legacy_logprobs(tokens: list[dict[str, Any]], offset: int) -> dict[str, Any]:
    """``/v1/completions``' form: parallel lists, the top tokens as ``{token: logprob}``."""
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t["token"])
    return {
        "tokens": [t["token"] for t in tokens],
        "token_logprobs": [t["logprob"] for t in tokens],
        "top_logprobs": [{x["token"]: x["logprob"] for x in t["top_logprobs"]} for t in tokens],
        "text_offset": offsets,
    }


def _embeddings(
    vectors: list[list[float]], encoding: str, model: str, usage: dict[str, int]
) -> dict[str, Any]:
    def encoded(v: list[float]) -> Any:
        if encoding != "base64":
            return v
        return base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode("ascii")

    tokens = usage["prompt_tokens"]
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": encoded(v)}
            for i, v in enumerate(vectors)
        ],
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def _response(
    choice: dict[str, Any],
    params: dict[str, Any],
    row: dict[str, Any],
    model: str,
    created: int,
    key: str,
    usage: dict[str, int],
) -> dict[str, Any]:
    """A ``Response`` (``/v1/responses``) of one text output."""
    cut = choice["finish_reason"] == "length"
    status = "incomplete" if cut else "completed"
    schema = params.get("json_schema")
    if schema is None:
        text_format: dict[str, Any] = {"type": "text"}
    elif schema == {"type": "object"}:
        text_format = {"type": "json_object"}
    else:
        text_format = {"type": "json_schema", "name": "schema", "schema": schema, "strict": True}
    messages = row["messages"]
    instructions = messages[0]["content"] if messages and messages[0]["role"] == "system" else None
    prompt, completion = usage["prompt_tokens"], usage["completion_tokens"]
    return {
        "id": f"resp_{key}",
        "object": "response",
        "created_at": created,
        "status": status,
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "error": None,
        "model": model,
        "instructions": instructions,
        "output": [
            {
                "type": "message",
                "id": f"msg_{key}",
                "status": status,
                "role": "assistant",
                "content": [{"type": "output_text", "text": choice["text"], "annotations": []}],
            }
        ],
        "parallel_tool_calls": False,
        "tool_choice": "none",
        "tools": [],
        "temperature": params["temperature"],
        "top_p": params["top_p"],
        "max_output_tokens": params["max_tokens"],
        "text": {"format": text_format},
        "metadata": {},
        "usage": {
            "input_tokens": prompt,
            "input_tokens_details": {
                "cached_tokens": usage["cached_tokens"],
                "cache_write_tokens": 0,
            },
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion,
        },
    }


class Written(NamedTuple):
    """What :func:`write_results` wrote: requests ``succeeded`` and ``failed``, and the
    answered requests' tokens (``prompt_tokens``, ``completion_tokens``, ``cached_tokens``)."""

    succeeded: int
    failed: int
    usage: dict[str, int]


def write_results(
    root: Path,
    read: Requests,
    result: BatchResult,
    model: str,
    *,
    not_run: tuple[str, str] | None = None,
) -> Written:
    """Write ``output.jsonl`` and ``errors.jsonl`` from the folder's rows, in input order,
    under the folder's lock; return how many requests succeeded and failed, and their tokens.

    ``not_run``: the top-level error ``(code, message)`` of requests the run did not answer
    (``batch_expired``, ``batch_cancelled``); default: a 500 ``server_error`` saying to run
    again.

    The folder's rows are read a batch at a time, in the order they were written (by
    prefix, not by input), and their lines spooled to a nameless file in the folder; the files are then
    written in input order from the spool: the answers are never all in memory.
    """
    failed = {  # custom_id -> why its unit failed
        custom_id: f"{e.type}: {e.message} (run the same command again to retry)"
        for e in result.errors.itertuples(index=False)
        for custom_id in (e.ids if isinstance(e.ids, list) else [])
    }
    note = f"pid {os.getpid()} on {socket.gethostname()} writing {OUTPUT}"
    try:
        lock = locks.try_lock(root / LOCK, note)
    except BlockingIOError as exc:
        raise OutputFolderError(f"output folder {root} is in use by another run ({exc})") from None
    counts = [0, 0]
    usage = {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}
    try:
        # Nameless (unlinked at once): nothing is left of it after a kill.
        with tempfile.TemporaryFile(dir=root) as spool:
            # Where each request's line is in the spool (-1: none), and whether it is good.
            where, good = array("q", [-1]) * len(read.items), bytearray(len(read.items))
            position = {r.custom_id: i for i, r in enumerate(read.items)}
            for frame in iter_predictions(root, COLUMNS):
                for row in frame.itertuples(index=False):
                    i = position.get(row.custom_id)
                    if i is None:
                        continue
                    line = _line(read.items[i], row, model, failed, not_run)
                    where[i], good[i] = spool.tell(), _good(line)
                    spool.write(json.dumps(line).encode() + b"\n")
                    if good[i]:
                        for name in usage:
                            usage[name] += int(getattr(row, name))
            with (
                atomic_file(root, root / OUTPUT, "w") as answers,
                atomic_file(root, root / ERRORS, "w") as problems,
            ):
                for i, request in enumerate(read.items):
                    if where[i] >= 0:
                        spool.seek(where[i])
                        text, ok = spool.readline().decode(), bool(good[i])
                    else:
                        line = _line(request, None, model, failed, not_run)
                        text, ok = json.dumps(line) + "\n", _good(line)
                    counts[not ok] += 1
                    (answers if ok else problems).write(text)
    finally:
        locks.unlock(lock)
    return Written(counts[0], counts[1], usage)


def _good(line: dict[str, Any]) -> bool:
    return line["response"] is not None and line["response"]["status_code"] == 200


def _line(
    request: Request,
    row: Any,
    model: str,
    failed: dict[str, str],
    not_run: tuple[str, str] | None,
) -> dict[str, Any]:
    key = key_of(model, request.custom_id)
    line: dict[str, Any] = {"id": f"batch_req_{key}", "custom_id": request.custom_id}
    refusal = request.error
    if refusal is None and row is None:
        if request.custom_id not in failed and not_run is not None:
            code, message = not_run
            return {**line, "response": None, "error": {"code": code, "message": message}}
        message = failed.get(request.custom_id, "not answered (run the same command again)")
        refusal = Refusal("server_error", message, 500, None, "server_error")
    elif refusal is None and isinstance(row.error, str):  # the layer's: it killed its worker
        refusal = Refusal("server_error", row.error, 500, None, "server_error")
    elif refusal is None and isinstance(row.error_code, str):
        param = row.error_param if isinstance(row.error_param, str) else None
        refusal = Refusal(row.error_code, row.error_message, STATUS.get(row.error_code, 400), param)
    if refusal is not None:
        error = {"message": refusal.message, "type": refusal.type, "param": refusal.param,
                 "code": refusal.code}  # fmt: skip
        response = {"status_code": refusal.status, "request_id": f"req_{key}",
                    "body": {"error": error}}  # fmt: skip
        return {**line, "response": response, "error": None}
    usage = {
        "prompt_tokens": int(row.prompt_tokens),
        "completion_tokens": int(row.completion_tokens),
        "cached_tokens": int(row.cached_tokens),
    }
    answer = body(request, json.loads(row.result), usage, model, int(row.created))
    response = {"status_code": 200, "request_id": f"req_{key}", "body": answer}
    return {**line, "response": response, "error": None}


@contextlib.contextmanager
def files_expected() -> Iterator[None]:
    """While open, the output folder's store does not warn that it holds files it did not
    write when they are only these (written here, to be there)."""
    store = logging.getLogger("dask_pcm.batch.store")
    quiet = _OurFiles()
    store.addFilter(quiet)
    try:
        yield
    finally:
        store.removeFilter(quiet)


class _OurFiles(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        names = args[1] if len(args) == 3 and isinstance(args[1], str) else None
        return not (names and set(names.split(", ")) <= {OUTPUT, ERRORS, "batch.json"})
