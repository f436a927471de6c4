"""OpenAI Batch API files run on a Dask cluster: ``dask-pcm batch -i requests.jsonl -o DIR``.

The input holds one request per line, as the Batch API takes them: ``custom_id``, ``method``
(``"POST"``), ``url`` and ``body``. Chat completions (``/v1/chat/completions``), completions
(``/v1/completions``, one prompt or a list), responses (``/v1/responses``, text in and out)
and embeddings (``/v1/embeddings``) may be mixed in one file; :func:`run_requests` answers
them with one :func:`~dask_pcm.run_batch` over the file, the model resident on the workers,
and writes what the Batch API writes:

- ``DIR/output.jsonl``: per answered request, in input order, ``{"id", "custom_id",
  "response": {"status_code": 200, "request_id", "body"}, "error": null}``; each ``body`` is
  a ``ChatCompletion``, ``Completion``, ``Response`` or ``CreateEmbeddingResponse``.
- ``DIR/errors.jsonl``: per failed request, as OpenAI writes it (:mod:`.output`): a 4xx/5xx
  ``response`` whose body is ``{"error": {"message", "type", "param", "code"}}``, or, for a
  request that did not run, ``"response": null`` and a top-level ``error``
  (``batch_expired``).
- ``DIR/batch.json``: the Batch object (:mod:`.status`): status, request counts, token usage.

What batch users send is answered: ``logprobs``/``top_logprobs``, ``response_format``
(``json_object``, ``json_schema``: the answer is decoded to follow it), ``n`` draws (seeded:
reproducible), ``stop``, ``seed``, embeddings as ``base64`` or shortened to ``dimensions``.
Requests whose prompts begin alike (a system prompt, few-shot examples) are put in the same
units wherever they are in the file, so that the model computes the shared tokens once
(``cached_tokens`` in the usage).

What goes wrong, and where it ends up:

- A line that is no request (not JSON, no ``custom_id``, ``body`` not an object...) stops the
  run before any work, naming ``file:line``, or with ``errors="skip"`` is skipped and counted.
  A ``custom_id`` used twice is refused either way, naming both lines.
- A request the file states but that cannot run here (another ``url`` or method, an
  unsupported parameter, a malformed field) is a 400 (``unsupported_url``,
  ``unsupported_parameter``, ``invalid_value``...); another model than the one served a 404
  ``model_not_found`` (unless ``any_model``); neither goes to a worker.
- A request that fails on its worker (a prompt too long for the model:
  ``context_length_exceeded``) is its own error; the others of its unit are answered.
- A unit that fails otherwise (out of memory, a worker lost) is a 500 ``server_error`` of each
  of its requests, and the next run tries it again.
- Requests not run when the ``completion_window`` ends are ``batch_expired``; the next run
  answers them.

``DIR`` is :func:`~dask_pcm.run_batch`'s resumable output folder: a rerun answers only what is
missing, and the files are written again, whole and atomically, at the end of every run.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from dask_pcm.apps.openai_batch.input import (
    ENDPOINTS,
    Refusal,
    Request,
    Requests,
    prefix_order,
    read_requests,
)
from dask_pcm.apps.openai_batch.output import ERRORS, OUTPUT, files_expected, write_results
from dask_pcm.apps.openai_batch.status import STATUS_FILE, BatchStatus, read_status
from dask_pcm.apps.openai_batch.task import CONTEXT, answer
from dask_pcm.batch.run import run_batch
from dask_pcm.batch.segments import read_predictions
from dask_pcm.context import language_model
from dask_pcm.exceptions import BatchInputError

__all__ = [
    "ENDPOINTS",
    "Outcome",
    "Refusal",
    "Request",
    "Requests",
    "answer",
    "parse_window",
    "read_requests",
    "read_status",
    "run_requests",
]

#: The responses' ``model`` when no model is given.
EMBEDDED_MODEL = "SmolLM2-135M-Instruct"
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


@dataclasses.dataclass
class Outcome:
    """What :func:`run_requests` did: requests ``succeeded`` and ``failed``, lines
    ``skipped`` (``problems``: ``file:line: what is wrong`` of each), the files written,
    the Batch object's final ``status`` and :func:`~dask_pcm.run_batch`'s ``report``."""

    succeeded: int
    failed: int
    skipped: int
    problems: list[str]
    output: Path
    errors: Path
    report: dict[str, Any]
    status: str = "completed"
    batch: Path | None = None


def parse_window(window: str | float | None) -> float | None:
    """Seconds of a completion window: ``"24h"``, ``"90m"``, ``"3600s"``, ``"2d"`` or a
    number of seconds; ``None``, ``"none"``: no window.

    Example
    -------
    >>> parse_window("24h"), parse_window(90), parse_window(None)
    (86400.0, 90.0, None)
    """
    if window is None or (isinstance(window, str) and window.strip().lower() == "none"):
        return None
    if isinstance(window, int | float) and not isinstance(window, bool):
        seconds = float(window)
    else:
        text = str(window).strip().lower()
        unit = _UNITS.get(text[-1:])
        try:
            seconds = float(text[:-1] if unit else text) * (unit or 1)
        except ValueError:
            raise ValueError(
                f"completion window {window!r}: a number of seconds, or with s, m, h or d "
                "(24h, 90m)"
            ) from None
    if not seconds > 0:
        raise ValueError(f"completion window {window!r}: must be more than 0 seconds")
    return seconds


def run_requests(
    requests: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    model: str | os.PathLike[str] | None = None,
    served_model_name: str | None = None,
    any_model: bool = False,
    cluster: Any = None,
    workers: int | None = None,
    errors: str = "raise",
    requests_per_unit: int = 16,
    level: str | None = None,
    timeout: float | None = None,
    completion_window: str | float | None = None,
    progress: bool = True,
    engine: str = "hf",
) -> Outcome:
    """Answer an OpenAI Batch API input file; write ``output.jsonl``, ``errors.jsonl`` and
    ``batch.json``.

    Parameters
    ----------
    requests
        The input file (see :func:`read_requests`; ``errors`` says what bad lines do).
    output
        The resumable folder (:func:`~dask_pcm.run_batch`'s ``output``) that also receives
        the files.
    model
        As for :func:`~dask_pcm.causal_lm`; default the embedded SmolLM2-135M-Instruct.
    served_model_name
        The ``model`` of the responses, and the one requests must name (default: the model's
        folder or file name); a request for another is a 404 ``model_not_found``.
    any_model
        Answer every request with the served model, whatever model it names.
    cluster, workers, level, timeout, progress
        As for :func:`~dask_pcm.run_batch`.
    requests_per_unit
        Requests per unit (``rows_per_unit``): the grain of a resume and of a failure.
    completion_window
        How long the run may take (:func:`parse_window`: ``"24h"``...); requests not run by
        then are ``batch_expired``, and a rerun answers them. Default: no window.
    engine
        ``"hf"``: dask_pcm's Hugging Face engine (:func:`~dask_pcm.causal_lm`); ``"vllm"``:
        vLLM on every worker (:func:`~dask_pcm.vllm_lm`; a Hugging Face folder as ``model``).

    Example
    -------
    >>> outcome = run_requests("requests.jsonl", "answers", errors="skip")   # doctest: +SKIP
    >>> outcome.succeeded, outcome.output                                    # doctest: +SKIP
    (198, PosixPath('answers/output.jsonl'))
    """
    window = parse_window(completion_window)
    root = Path(output)
    name = served_model_name or (EMBEDDED_MODEL if model is None else Path(model).name)
    shown_window = None if completion_window is None else str(completion_window)
    status = BatchStatus(root, Path(requests), name, shown_window)
    try:
        read = read_requests(requests, errors, model=name, any_model=any_model)
    except BatchInputError as exc:
        status.fail(str(exc))
        raise
    rows = prefix_order([r.row for r in read.items if r.row is not None])
    refused = sum(r.error is not None for r in read.items)
    endpoints = sorted({r.url for r in read.items if r.row is not None})

    def started(client: Any, units: Any) -> None:
        status.start(len(read.items), refused, endpoints, window)
        status.add(*_counted(_earlier(root)))

    context = language_model(model, name=CONTEXT, engine=engine)
    try:
        with files_expected():
            result = run_batch(
                answer, rows, contexts=context, cluster=cluster, id_column="custom_id",
                rows_per_unit=requests_per_unit, output=output, on_error="skip",
                timeout=timeout, level=level, workers=workers, progress=progress,
                prepare=started, on_unit=lambda n, table, record: status.add(
                    *_counted(table, record)), deadline=window, context=CONTEXT,
            )  # fmt: skip
    except KeyboardInterrupt:
        status.cancel()
        raise
    except Exception as exc:
        status.fail(f"{type(exc).__name__}: {exc}")
        raise
    expired = bool(result.report.get("expired"))
    not_run = None
    if expired:
        message = (
            f"This request was not run within the completion window ({completion_window}); "
            "run the same command again to answer it"
        )
        not_run = ("batch_expired", message)
    written = write_results(root, read, result, name, not_run=not_run)
    final = "expired" if expired else "completed"
    status.finish(final, written.succeeded, written.failed, written.usage)
    paths = (root / OUTPUT, root / ERRORS)
    return Outcome(
        written.succeeded, written.failed, read.skipped, read.problems, *paths, result.report,
        final, root / STATUS_FILE,
    )  # fmt: skip


def _earlier(root: Path) -> Any:
    """The rows earlier runs left in the folder (their counts go into the Batch object)."""
    try:
        return read_predictions(root, columns=_COUNTED)
    except (OSError, ValueError, KeyError):
        return None


_COUNTED = ["error_code", "prompt_tokens", "completion_tokens", "cached_tokens"]


def _counted(table: Any, record: dict[str, Any] | None = None) -> tuple[int, int, dict[str, int]]:
    """Requests answered and failed in ``table`` (rows of the output: an Arrow table, or a
    pandas frame of earlier runs' rows), or in a failed unit's ``record``, and their tokens."""
    if table is None:
        failed = len(record.get("ids") or []) if record else 0
        return 0, failed, {}
    if hasattr(table, "iloc"):  # pandas
        import pyarrow as pa

        table = pa.Table.from_pandas(table, preserve_index=False)
    import pyarrow.compute as pc

    names = set(table.column_names)
    if table.num_rows == 0:
        return 0, 0, {}
    good = pc.is_null(table["error_code"]) if "error_code" in names else None
    if "error" in names:
        no_error = pc.is_null(table["error"])
        good = no_error if good is None else pc.and_(good, no_error)
    answered = table.num_rows if good is None else int(pc.sum(good).as_py() or 0)
    tokens = {c: int(pc.sum(table[c]).as_py() or 0) for c in _COUNTED[1:] if c in names}
    return answered, table.num_rows - answered, tokens
