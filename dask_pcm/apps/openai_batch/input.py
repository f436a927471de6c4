"""Reading an OpenAI Batch API input file: which lines are requests, and which requests can
run here.

A line that is no request (not JSON, no ``custom_id``, no ``method``, ``url`` or ``body``) is a
problem of the file (:class:`~dask_pcm.exceptions.BatchInputError` naming ``file:line``, or
skipped and counted). A request that is well formed but cannot run here (another ``url``,
``n`` > 1, a parameter this runner does not implement, a malformed field) is refused with an
error code and message, as the OpenAI API would answer it, and goes to no worker. Each
request that can run becomes a *row* of :func:`~dask_pcm.run_batch`: ``custom_id``,
``endpoint`` (``chat``, ``completion`` or ``embedding``) and what the task needs.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from dask_pcm.exceptions import BatchInputError

ENDPOINTS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completion",
    "/v1/embeddings": "embedding",
}
#: Tokens generated when a request sets no limit (completions: as the OpenAI API).
DEFAULT_MAX_TOKENS = {"chat": 256, "completion": 16}
# Body keys read (or harmless: the model asked for is answered by the run's model).
_KNOWN = {
    "chat": {
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "seed",
        "stop",
    },
    "completion": {"prompt", "max_tokens", "temperature", "top_p", "seed", "stop"},
    "embedding": {"input", "encoding_format"},
}
_IGNORED = {"model", "user", "metadata", "store", "n", "stream"}


class _Refused(Exception):
    """A request that cannot run here: its error ``code`` and message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclasses.dataclass
class Request:
    """One request of the input: its ``line``, and the ``row`` a worker runs or the
    ``error`` (code, message) it was refused with."""

    custom_id: str
    line: int
    row: dict[str, Any] | None = None
    error: tuple[str, str] | None = None


@dataclasses.dataclass
class Requests:
    """The requests of a file, in order, and the lines skipped (``errors="skip"``)."""

    path: Path
    items: list[Request]
    skipped: int = 0
    problems: list[str] = dataclasses.field(default_factory=list)


def read_requests(path: str | os.PathLike[str], errors: str = "raise") -> Requests:
    """Read and check an OpenAI Batch API input file.

    Parameters
    ----------
    path
        JSON lines: ``custom_id``, ``method``, ``url``, ``body`` per line.
    errors
        A line that is no request: ``"raise"`` (:class:`~dask_pcm.exceptions.BatchInputError`
        naming ``file:line``) or ``"skip"`` (counted in ``skipped``, quoted in ``problems``).
        A duplicate ``custom_id`` raises either way, naming both lines.

    Example
    -------
    >>> read_requests("requests.jsonl").items[0].row["endpoint"]   # doctest: +SKIP
    'chat'
    """
    if errors not in ("raise", "skip"):
        raise ValueError(f"errors must be 'raise' or 'skip', not {errors!r}")
    path = Path(path)
    out = Requests(path, [])
    first: dict[str, int] = {}
    try:
        lines = path.read_bytes().splitlines()
    except OSError as exc:
        raise BatchInputError(f"{path}: cannot be read: {exc}") from None
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            record = _record(raw, number)
        except _Refused as exc:
            message = f"{path}:{number}: {exc}"
            if errors == "raise":
                raise BatchInputError(f"{message} (--errors skip skips such lines)") from None
            out.skipped += 1
            out.problems.append(message)
            continue
        custom_id = record["custom_id"]
        if custom_id in first:
            raise BatchInputError(
                f"{path}:{number}: custom_id {custom_id!r} is already used on line "
                f"{first[custom_id]}; each request needs its own"
            )
        first[custom_id] = number
        request = Request(custom_id, number)
        try:
            request.row = {"custom_id": custom_id, **_row(record)}
        except _Refused as exc:
            request.error = (exc.code, str(exc))
        out.items.append(request)
    return out


def _record(raw: bytes, number: int) -> dict[str, Any]:
    """The line as a request object; _Refused saying what is wrong with it."""
    try:
        record = json.loads(raw.decode("utf-8-sig" if number == 1 else "utf-8"))
    except UnicodeDecodeError as exc:
        raise _Refused("", f"not valid UTF-8 (at byte {exc.start})") from None
    except ValueError as exc:
        raise _Refused("", f"invalid JSON ({exc})") from None
    if not isinstance(record, dict):
        raise _Refused("", "expected a JSON object")
    custom_id = record.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise _Refused("", "no custom_id (a non-empty string)")
    for key, kind in (("method", str), ("url", str), ("body", dict)):
        if not isinstance(record.get(key), kind):
            what = "an object" if kind is dict else "a string"
            raise _Refused("", f"request {custom_id!r}: {key!r} is missing or not {what}")
    return record


def _row(record: dict[str, Any]) -> dict[str, Any]:
    """What a worker needs to answer the request; _Refused if it cannot run here."""
    url, body = record["url"], record["body"]
    if record["method"].upper() != "POST":
        raise _Refused("unsupported_method", f"method {record['method']!r}: only POST")
    endpoint = ENDPOINTS.get(url)
    if endpoint is None:
        raise _Refused("unsupported_url", f"url {url!r}: one of {', '.join(ENDPOINTS)}")
    unknown = sorted(k for k, v in body.items() if v and k not in _KNOWN[endpoint] | _IGNORED)
    if unknown:
        raise _Refused("unsupported_parameter", f"not supported here: {', '.join(unknown)}")
    if body.get("n") not in (None, 1):
        raise _Refused("unsupported_value", f"n={body['n']!r}: only n=1")
    if body.get("stream"):
        raise _Refused("unsupported_value", "stream: a batch answers whole")
    if endpoint == "embedding":
        return {"endpoint": endpoint, "input": _inputs(body)}
    row: dict[str, Any] = {"endpoint": endpoint, "params": _params(body, endpoint)}
    if endpoint == "chat":
        row["messages"] = _messages(body.get("messages"))
    elif isinstance(body.get("prompt"), str):
        row["prompt"] = body["prompt"]
    else:
        raise _Refused("invalid_request", "prompt: a string is required (lists are not supported)")
    return row


def _params(body: dict[str, Any], endpoint: str) -> dict[str, Any]:
    """The generation parameters (:func:`~dask_pcm.apps.llm.generate`'s), checked."""
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    limit = DEFAULT_MAX_TOKENS[endpoint] if limit is None else limit
    # None: the API's defaults, temperature 1 (sampling) and top_p 1.
    temperature = 1.0 if body.get("temperature") is None else body["temperature"]
    top_p = 1.0 if body.get("top_p") is None else body["top_p"]
    seed, stop = body.get("seed"), body.get("stop")
    if not (_is_int(limit) and limit >= 1):
        raise _Refused("invalid_request", f"max_tokens={limit!r}: a positive integer")
    if not (_is_number(temperature) and 0 <= temperature <= 2):
        raise _Refused("invalid_request", f"temperature={temperature!r}: 0 to 2")
    if not (_is_number(top_p) and 0 < top_p <= 1):
        raise _Refused("invalid_request", f"top_p={top_p!r}: above 0, at most 1")
    if not (seed is None or _is_int(seed)):
        raise _Refused("invalid_request", f"seed={seed!r}: an integer")
    if not (stop is None or isinstance(stop, str) or _strings(stop)):
        raise _Refused("invalid_request", f"stop={stop!r}: a string or a list of strings")
    return {
        "max_tokens": limit,
        "temperature": temperature,
        "top_p": top_p,
        "seed": seed,
        "stop": stop,
    }


def _messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise _Refused("invalid_request", "messages: a non-empty list is required")
    out = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):  # content parts: text only
            parts = [p.get("text") if isinstance(p, dict) else None for p in content]
            if not all(isinstance(p, str) for p in parts):
                raise _Refused("unsupported_value", f"messages[{i}]: only text content parts")
            content = "".join(parts)  # type: ignore[arg-type]
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise _Refused("invalid_request", f"messages[{i}]: an object with a 'role'")
        if not isinstance(content, str | None):
            raise _Refused("invalid_request", f"messages[{i}]: 'content' is not text")
        out.append({"role": message["role"], "content": content or ""})
    return out


def _inputs(body: dict[str, Any]) -> list[str]:
    if body.get("encoding_format") not in (None, "float"):
        raise _Refused("unsupported_value", "encoding_format: only 'float'")
    given = body.get("input")
    inputs = [given] if isinstance(given, str) else given
    if not _strings(inputs) or not inputs:
        raise _Refused("invalid_request", "input: a string or a non-empty list of strings")
    return list(inputs)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)
