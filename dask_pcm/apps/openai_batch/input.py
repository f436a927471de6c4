"""Reading an OpenAI Batch API input file: which lines are requests, and which requests can
run here.

A line that is no request (not JSON, no ``custom_id``, no ``method``, ``url`` or ``body``) is a
problem of the file (:class:`~dask_pcm.exceptions.BatchInputError` naming ``file:line``, or
skipped and counted). A request that is well formed but cannot run here (another ``url``, a
parameter this runner does not implement, a malformed field, another model than the one
served) is refused as the OpenAI API would answer it (:class:`Refusal`: HTTP status, error
code, parameter, message) and goes to no worker. Each request that can run becomes a *row*
of :func:`~dask_pcm.run_batch`: ``custom_id``, ``endpoint`` (``chat``, ``completion``,
``responses`` or ``embedding``), ``params`` (the task's parameters as JSON text) and its
inputs: ``messages`` (a chat, a response's input), ``prompts`` (completions: one or more) or
``input`` (embeddings).
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
    "/v1/responses": "responses",
    "/v1/embeddings": "embedding",
}
#: Tokens generated when a request sets no limit (completions: as the OpenAI API).
DEFAULT_MAX_TOKENS = {"chat": 256, "completion": 16, "responses": 256}
#: Most ``top_logprobs`` (chat; the OpenAI API's limit) and ``logprobs`` (completions).
MOST_TOP_LOGPROBS = {"chat": 20, "completion": 5}
_SAMPLING = {"temperature", "top_p", "seed", "n"}
# Body keys read, per endpoint.
_KNOWN = {
    "chat": {"messages", "max_tokens", "max_completion_tokens", "stop", "logprobs",
             "top_logprobs", "response_format", *_SAMPLING},
    "completion": {"prompt", "max_tokens", "stop", "logprobs", *_SAMPLING},
    "responses": {"input", "instructions", "max_output_tokens", "text", "temperature",
                  "top_p"},
    "embedding": {"input", "encoding_format", "dimensions"},
}  # fmt: skip
# Harmless here: bookkeeping of the API's own (``model`` is checked against the served one).
_IGNORED = {"model", "user", "metadata", "store", "stream", "service_tier", "safety_identifier"}


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Why a request cannot run here, as the OpenAI API answers it: the HTTP ``status``,
    the error's ``code``, ``message``, ``param`` (the body field at fault) and ``type``."""

    code: str
    message: str
    status: int = 400
    param: str | None = None
    type: str = "invalid_request_error"


class _Refused(Exception):
    def __init__(self, code: str, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.refusal = Refusal(code, message, status, param)


@dataclasses.dataclass
class Request:
    """One request of the input: its ``line``, ``url``, and the ``row`` a worker runs or the
    :class:`Refusal` it was refused with."""

    custom_id: str
    line: int
    url: str = ""
    row: dict[str, Any] | None = None
    error: Refusal | None = None


@dataclasses.dataclass
class Requests:
    """The requests of a file, in order, and the lines skipped (``errors="skip"``)."""

    path: Path
    items: list[Request]
    skipped: int = 0
    problems: list[str] = dataclasses.field(default_factory=list)


def read_requests(
    path: str | os.PathLike[str],
    errors: str = "raise",
    *,
    model: str | None = None,
    any_model: bool = False,
) -> Requests:
    """Read and check an OpenAI Batch API input file.

    Parameters
    ----------
    path
        JSON lines: ``custom_id``, ``method``, ``url``, ``body`` per line.
    errors
        A line that is no request: ``"raise"`` (:class:`~dask_pcm.exceptions.BatchInputError`
        naming ``file:line``) or ``"skip"`` (counted in ``skipped``, quoted in ``problems``).
        A duplicate ``custom_id`` raises either way, naming both lines.
    model
        The served model's name: a request for another (``body.model``) is refused with a
        404 ``model_not_found``, unless ``any_model``. ``None``: every model is answered.
    any_model
        Answer every request with the served model, whatever model it names.

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
        handle = open(path, "rb")  # noqa: SIM115 (closed below; read a line at a time)
    except OSError as exc:
        raise BatchInputError(f"{path}: cannot be read: {exc}") from None
    with handle:
        for number, raw in enumerate(handle, start=1):
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
            request = Request(custom_id, number, record["url"])
            try:
                _check_model(record["body"], model, any_model)
                request.row = {"custom_id": custom_id, **_row(record)}
            except _Refused as exc:
                request.error = exc.refusal
            out.items.append(request)
    return out


def prefix_order(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` ordered so that requests whose prompts begin alike sit together (whatever
    their order in the file): by endpoint and parameters, then by their messages or
    prompts as text, so that a system prompt or few-shot examples shared by some requests
    put those in the same units, where the model computes the shared tokens once.

    Example
    -------
    >>> rows = [{"endpoint": "completion", "params": "{}", "prompts": [p]} for p in "bab"]
    >>> [r["prompts"][0] for r in prefix_order(rows)]
    ['a', 'b', 'b']
    """

    def key(row: dict[str, Any]) -> tuple[str, str, str]:
        if row.get("messages") is not None:
            text = "\0".join(f"{m['role']}\0{m['content']}" for m in row["messages"])
        else:
            text = "\0".join(row.get("prompts") or row.get("input") or ())
        return (row["endpoint"], row["params"], text)

    return sorted(rows, key=key)


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


def _check_model(body: dict[str, Any], served: str | None, any_model: bool) -> None:
    asked = body.get("model")
    if served is None or any_model or asked is None or asked == served:
        return
    raise _Refused(
        "model_not_found",
        f"The model {asked!r} does not exist here: this run serves {served!r} "
        "(--served-model-name names it; --any-model answers every request with it)",
        "model",
        404,
    )


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
        raise _Refused(
            "unsupported_parameter", f"not supported here: {', '.join(unknown)}", unknown[0]
        )
    if body.get("stream"):
        raise _Refused("unsupported_value", "stream: a batch answers whole", "stream")
    if endpoint == "embedding":
        return {"endpoint": endpoint, "input": _inputs(body), **_embedding(body)}
    row: dict[str, Any] = {"endpoint": endpoint, "params": json.dumps(_params(body, endpoint))}
    if endpoint == "chat":
        row["messages"] = _messages(body.get("messages"), "messages")
    elif endpoint == "responses":
        row["messages"] = _response_input(body)
    else:
        row["prompts"] = _prompts(body.get("prompt"))
    return row


def _params(body: dict[str, Any], endpoint: str) -> dict[str, Any]:
    """The generation parameters (:func:`~dask_pcm.apps.llm.generate`'s, and ``n``), checked."""
    names = {"responses": "max_output_tokens", "chat": "max_completion_tokens"}
    limit = body.get(names.get(endpoint, "max_tokens")) or body.get("max_tokens")
    limit = DEFAULT_MAX_TOKENS[endpoint] if limit is None else limit
    # None: the API's defaults, temperature 1 (sampling) and top_p 1.
    temperature = 1.0 if body.get("temperature") is None else body["temperature"]
    top_p = 1.0 if body.get("top_p") is None else body["top_p"]
    seed, stop, n = body.get("seed"), body.get("stop"), body.get("n", 1)
    n = 1 if n is None else n
    if not (_is_int(limit) and limit >= 1):
        raise _Refused("invalid_value", f"max_tokens={limit!r}: a positive integer", "max_tokens")
    if not (_is_number(temperature) and 0 <= temperature <= 2):
        raise _Refused("invalid_value", f"temperature={temperature!r}: 0 to 2", "temperature")
    if not (_is_number(top_p) and 0 < top_p <= 1):
        raise _Refused("invalid_value", f"top_p={top_p!r}: above 0, at most 1", "top_p")
    if not (seed is None or _is_int(seed)):
        raise _Refused("invalid_value", f"seed={seed!r}: an integer", "seed")
    if not (stop is None or isinstance(stop, str) or _strings(stop)):
        raise _Refused("invalid_value", f"stop={stop!r}: a string or a list of strings", "stop")
    if not (_is_int(n) and 1 <= n <= 128):
        raise _Refused("invalid_value", f"n={n!r}: an integer from 1 to 128", "n")
    return {
        "max_tokens": limit,
        "temperature": temperature,
        "top_p": top_p,
        "seed": seed,
        "stop": stop,
        "n": n,
        "logprobs": _logprobs(body, endpoint),
        "json_schema": _json_schema(body, endpoint),
    }


def _logprobs(body: dict[str, Any], endpoint: str) -> int | None:
    """How many most likely tokens to report per generated token; None: no log-probabilities."""
    if endpoint == "completion":  # logprobs: the number itself (0 to 5), None for none
        given, param = body.get("logprobs"), "logprobs"
    else:  # chat: logprobs true, and top_logprobs the number (0 to 20)
        if body.get("logprobs") not in (None, False, True):
            raise _Refused("invalid_value", "logprobs: true or false", "logprobs")
        if not body.get("logprobs"):
            if body.get("top_logprobs"):
                raise _Refused("invalid_value", "top_logprobs needs logprobs: true", "logprobs")
            return None
        given, param = body.get("top_logprobs") or 0, "top_logprobs"
    if given is None:
        return None
    most = MOST_TOP_LOGPROBS[endpoint]
    if not (_is_int(given) and 0 <= given <= most):
        raise _Refused("invalid_value", f"{param}={given!r}: an integer from 0 to {most}", param)
    return int(given)


def _json_schema(body: dict[str, Any], endpoint: str) -> dict[str, Any] | None:
    """The JSON Schema the answer must follow (``{"type": "object"}`` for any JSON object),
    from ``response_format`` (chat) or ``text.format`` (responses); None: free text."""
    if endpoint == "responses":
        text = body.get("text") or {}
        if not isinstance(text, dict):
            raise _Refused("invalid_type", "text: an object", "text")
        given, param = text.get("format"), "text.format"
        nested = given  # responses: name, schema and strict beside the type
    else:
        given, param = body.get("response_format"), "response_format"
        nested = given.get("json_schema") if isinstance(given, dict) else None
    if given is None:
        return None
    kind = given.get("type") if isinstance(given, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind != "json_schema":
        raise _Refused(
            "invalid_value", f"{param}: type 'text', 'json_object' or 'json_schema'", param
        )
    schema = nested.get("schema") if isinstance(nested, dict) else None
    if not isinstance(schema, dict):
        raise _Refused("invalid_value", f"{param}: json_schema needs a 'schema' object", param)
    return schema


def _messages(messages: Any, param: str) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise _Refused(
            "missing_required_parameter", f"{param}: a non-empty list is required", param
        )
    out = []
    for i, message in enumerate(messages):
        where = f"{param}[{i}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise _Refused("invalid_value", f"{where}: an object with a 'role'", where)
        content = message.get("content")
        if isinstance(content, list):  # content parts: text only
            parts = [p.get("text") if isinstance(p, dict) else None for p in content]
            kinds = {p.get("type") for p in content if isinstance(p, dict)}
            if not all(isinstance(p, str) for p in parts) or not kinds <= {
                "text", "input_text", "output_text", None
            }:  # fmt: skip
                raise _Refused("unsupported_value", f"{where}: only text content parts", where)
            content = "".join(parts)  # type: ignore[arg-type]
        if not isinstance(content, str | None):
            raise _Refused("invalid_value", f"{where}: 'content' is not text", where)
        role = "system" if message["role"] == "developer" else message["role"]
        out.append({"role": role, "content": content or ""})
    return out


def _response_input(body: dict[str, Any]) -> list[dict[str, str]]:
    """A response's ``instructions`` and ``input`` (a string, or message items) as a chat."""
    given = body.get("input")
    if isinstance(given, str):
        items: Any = [{"role": "user", "content": given}]
    elif isinstance(given, list) and given:
        for i, item in enumerate(given):
            if isinstance(item, dict) and item.get("type", "message") != "message":
                raise _Refused(
                    "unsupported_value", f"input[{i}]: only message items (text)", f"input[{i}]"
                )
        items = given
    else:
        raise _Refused(
            "missing_required_parameter", "input: a string or a list of messages", "input"
        )
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _Refused("invalid_type", "instructions: a string", "instructions")
    system = [{"role": "system", "content": instructions}] if instructions else []
    return system + _messages(items, "input")


def _prompts(given: Any) -> list[str]:
    if isinstance(given, str):
        return [given]
    if _strings(given) and given:
        return list(given)
    if isinstance(given, list) and given and all(_is_int(t) or isinstance(t, list) for t in given):
        raise _Refused(
            "unsupported_value", "prompt: token ids are not supported, text only", "prompt"
        )
    raise _Refused("invalid_value", "prompt: a string or a non-empty list of strings", "prompt")


def _inputs(body: dict[str, Any]) -> list[str]:
    given = body.get("input")
    inputs = [given] if isinstance(given, str) else given
    if not _strings(inputs) or not inputs:
        raise _Refused("invalid_value", "input: a string or a non-empty list of strings", "input")
    return list(inputs)


def _embedding(body: dict[str, Any]) -> dict[str, Any]:
    encoding = body.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise _Refused("invalid_value", "encoding_format: 'float' or 'base64'", "encoding_format")
    dimensions = body.get("dimensions")
    if not (dimensions is None or (_is_int(dimensions) and dimensions >= 1)):
        raise _Refused(
            "invalid_value", f"dimensions={dimensions!r}: a positive integer", "dimensions"
        )
    return {"params": json.dumps({"dimensions": dimensions}), "encoding": encoding}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)
