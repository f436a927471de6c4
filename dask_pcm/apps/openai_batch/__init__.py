"""OpenAI Batch API files run on a Dask cluster: ``dask-pcm batch -i requests.jsonl -o DIR``.

The input holds one request per line, as the Batch API takes them: ``custom_id``, ``method``
(``"POST"``), ``url`` and ``body``. Chat completions (``/v1/chat/completions``), completions
(``/v1/completions``, a string prompt) and embeddings (``/v1/embeddings``) may be mixed in one
file; :func:`run_requests` answers them with one :func:`~dask_pcm.run_batch` over the file, the
model resident on the workers, and writes what the Batch API writes:

- ``DIR/output.jsonl``: per answered request, in input order, ``{"id", "custom_id",
  "response": {"status_code": 200, "request_id", "body"}, "error": null}``; each ``body`` is
  a ``ChatCompletion``, ``Completion`` or ``CreateEmbeddingResponse``.
- ``DIR/errors.jsonl``: per failed request ``{"id", "custom_id", "response": null, "error":
  {"code", "message"}}``.

What goes wrong, and where it ends up:

- A line that is no request (not JSON, no ``custom_id``, ``body`` not an object...) stops the
  run before any work, naming ``file:line``, or with ``errors="skip"`` is skipped and counted.
  A ``custom_id`` used twice is refused either way, naming both lines.
- A request the file states but that cannot run here (another ``url`` or method, ``n`` > 1,
  an unsupported parameter, a malformed field) is a request error (``unsupported_url``,
  ``unsupported_value``, ``invalid_request``...), sent to no worker.
- A request that fails on its worker (a prompt too long for the model:
  ``context_length_exceeded``) is its own error; the others of its unit are answered.
- A unit that fails otherwise (out of memory, a worker lost) is a ``server_error`` of each of
  its requests, and the next run tries it again.

``DIR`` is :func:`~dask_pcm.run_batch`'s resumable output folder: a rerun answers only what is
missing, and both files are written again, whole and atomically, at the end of every run.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from dask_pcm.apps.openai_batch.input import ENDPOINTS, Request, Requests, read_requests
from dask_pcm.apps.openai_batch.output import ERRORS, OUTPUT, files_expected, write_results
from dask_pcm.apps.openai_batch.task import CONTEXT, answer
from dask_pcm.batch.run import run_batch
from dask_pcm.context import causal_lm

__all__ = ["ENDPOINTS", "Outcome", "Request", "Requests", "answer", "read_requests", "run_requests"]

#: The responses' ``model`` when no model is given.
EMBEDDED_MODEL = "SmolLM2-135M-Instruct"


@dataclasses.dataclass
class Outcome:
    """What :func:`run_requests` did: requests ``succeeded`` and ``failed``, lines
    ``skipped`` (``problems``: ``file:line: what is wrong`` of each), the two files written,
    and :func:`~dask_pcm.run_batch`'s ``report``."""

    succeeded: int
    failed: int
    skipped: int
    problems: list[str]
    output: Path
    errors: Path
    report: dict[str, Any]


def run_requests(
    requests: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    model: str | os.PathLike[str] | None = None,
    cluster: Any = None,
    workers: int | None = None,
    errors: str = "raise",
    requests_per_unit: int = 16,
    level: str | None = None,
    timeout: float | None = None,
    progress: bool = True,
) -> Outcome:
    """Answer an OpenAI Batch API input file; write ``output.jsonl`` and ``errors.jsonl``.

    Parameters
    ----------
    requests
        The input file (see :func:`read_requests`; ``errors`` says what bad lines do).
    output
        The resumable folder (:func:`~dask_pcm.run_batch`'s ``output``) that also receives
        the two files.
    model
        As for :func:`~dask_pcm.causal_lm`; default the embedded SmolLM2-135M-Instruct. Its
        folder or file name is the ``model`` of the responses.
    cluster, workers, level, timeout, progress
        As for :func:`~dask_pcm.run_batch`.
    requests_per_unit
        Requests per unit (``rows_per_unit``): the grain of a resume and of a failure.

    Example
    -------
    >>> outcome = run_requests("requests.jsonl", "answers", errors="skip")   # doctest: +SKIP
    >>> outcome.succeeded, outcome.output                                    # doctest: +SKIP
    (198, PosixPath('answers/output.jsonl'))
    """
    read = read_requests(requests, errors)
    rows = [r.row for r in read.items if r.row is not None]
    context = causal_lm(model, name=CONTEXT)
    name = EMBEDDED_MODEL if model is None else Path(model).name
    with files_expected():
        result = run_batch(
            answer, rows, contexts=context, cluster=cluster, id_column="custom_id",
            rows_per_unit=requests_per_unit, output=output, on_error="skip", timeout=timeout,
            level=level, workers=workers, progress=progress, context=CONTEXT,
        )  # fmt: skip
    root = Path(output)
    succeeded, failed = write_results(root, read, result, name)
    paths = (root / OUTPUT, root / ERRORS)
    return Outcome(succeeded, failed, read.skipped, read.problems, *paths, result.report)
