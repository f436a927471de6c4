"""What a run of an OpenAI Batch API file writes: ``output.jsonl`` and ``errors.jsonl``.

Both are written again at the end of every run (a resume too) from the output folder's rows
and the input's refused requests, in input order, each whole or not at all, under the
folder's lock. Every id is stable: derived from the model's name and the ``custom_id``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dask_pcm import locks
from dask_pcm.apps.openai_batch.input import Request, Requests
from dask_pcm.batch.files import LOCK, atomic_file
from dask_pcm.batch.run import BatchResult
from dask_pcm.exceptions import OutputFolderError

OUTPUT, ERRORS = "output.jsonl", "errors.jsonl"
#: The columns of the output folder that the files are made from.
COLUMNS = ["custom_id", "created", "result", "error_code", "error_message", "error"]


def body(
    endpoint: str, result: dict[str, Any], model: str, created: int, key: str
) -> dict[str, Any]:
    """The response body the OpenAI API would give for ``result``, what the task returned for
    one request (:func:`~dask_pcm.apps.openai_batch.task.answer`); ``key`` makes its ``id``.

    Example
    -------
    >>> body("completion", {"text": " Paris", "finish_reason": "stop", "prompt_tokens": 5,
    ...      "completion_tokens": 2}, "tiny", 0, "abc")["choices"][0]["text"]
    ' Paris'
    """
    if endpoint == "embedding":
        tokens = result["tokens"]
        return {
            "object": "list",
            "data": [
                {"object": "embedding", "index": i, "embedding": v}
                for i, v in enumerate(result["embeddings"])
            ],
            "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
    prompt, completion = result["prompt_tokens"], result["completion_tokens"]
    choice: dict[str, Any] = {
        "index": 0,
        "finish_reason": result["finish_reason"],
        "logprobs": None,
    }
    if endpoint == "chat":
        choice["message"] = {"role": "assistant", "content": result["text"], "refusal": None}
    else:
        choice["text"] = result["text"]
    return {
        "id": f"{'chatcmpl' if endpoint == 'chat' else 'cmpl'}-{key}",
        "object": "chat.completion" if endpoint == "chat" else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
    }


def write_results(root: Path, read: Requests, result: BatchResult, model: str) -> tuple[int, int]:
    """Write ``output.jsonl`` and ``errors.jsonl`` from the folder's rows, in input order,
    under the folder's lock; return how many requests succeeded and failed."""
    rows = {r.custom_id: r for r in result.to_pandas(COLUMNS).itertuples(index=False)}
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
    try:
        with (
            atomic_file(root, root / OUTPUT, "w") as answers,
            atomic_file(root, root / ERRORS, "w") as problems,
        ):
            for request in read.items:
                line = _line(request, rows.get(request.custom_id), model, failed)
                good = line["error"] is None
                counts[not good] += 1
                (answers if good else problems).write(json.dumps(line) + "\n")
    finally:
        locks.unlock(lock)
    return counts[0], counts[1]


def _line(request: Request, row: Any, model: str, failed: dict[str, str]) -> dict[str, Any]:
    key = hashlib.sha256(f"{model}\0{request.custom_id}".encode()).hexdigest()[:24]
    line: dict[str, Any] = {"id": f"batch_req_{key}", "custom_id": request.custom_id}
    if request.error is not None:
        code, message = request.error
    elif row is None:
        code = "server_error"
        message = failed.get(request.custom_id, "not answered (run the same command again)")
    elif isinstance(row.error, str):  # the layer's: the request killed its worker
        code, message = "server_error", row.error
    elif isinstance(row.error_code, str):
        code, message = row.error_code, row.error_message
    else:
        result = json.loads(row.result)
        answer = body(request.row["endpoint"], result, model, int(row.created), key)  # type: ignore[index]
        response = {"status_code": 200, "request_id": f"req_{key}", "body": answer}
        return {**line, "response": response, "error": None}
    return {**line, "response": None, "error": {"code": code, "message": message}}


@contextlib.contextmanager
def files_expected() -> Iterator[None]:
    """While open, the output folder's store does not warn that it holds files it did not
    write when they are only these two (written here, to be there)."""
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
        return not (names and set(names.split(", ")) <= {OUTPUT, ERRORS})
