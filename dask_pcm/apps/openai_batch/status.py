"""``DIR/batch.json``: how a batch is going, shaped like the OpenAI API's Batch object.

``status`` goes ``validating`` (the input being read) → ``in_progress`` → ``completed``
(every request answered or failed), ``expired`` (the completion window ended first),
``cancelled`` (interrupted) or ``failed`` (the input was refused, or the cluster was lost).
``request_counts`` (``total``, ``completed``, ``failed``) and ``usage`` (``input_tokens``,
``input_tokens_details.cached_tokens``, ``output_tokens``, ``total_tokens``) are updated
as units are written, at most every ``pcm.batch.flush-interval``, and at the end from the
files written. The object keeps its ``id`` and ``created_at`` across reruns of one folder;
each run sets the times of its own steps. It is written once the folder is the batch
layer's (its manifest written; on a new folder, ``validating`` stays in memory).
``dask-pcm batch --status DIR`` prints it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from pathlib import Path
from typing import Any

from dask_pcm import config
from dask_pcm.apps.openai_batch.output import ERRORS, OUTPUT
from dask_pcm.batch.files import MANIFEST, write_atomically

STATUS_FILE = "batch.json"
_USAGE = ("prompt_tokens", "completion_tokens", "cached_tokens")


def read_status(folder: str | Path) -> dict[str, Any]:
    """The Batch object of an output folder; OSError or ValueError naming the file."""
    path = Path(folder) / STATUS_FILE
    try:
        return dict(json.loads(path.read_text()))
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file (not a dask-pcm batch folder?)") from None
    except ValueError as exc:
        raise ValueError(f"{path}: not a Batch object ({exc})") from None


class BatchStatus:
    """The Batch object of one run over ``root``, written at each step (see the module)."""

    def __init__(self, root: Path, requests: Path, model: str, window: str | None) -> None:
        self.root = root
        self.path = root / STATUS_FILE
        now = int(time.time())
        digest = hashlib.sha256(f"{requests.resolve()}\0{root.resolve()}".encode()).hexdigest()
        earlier: dict[str, Any] = {}
        with contextlib.suppress(OSError, ValueError):
            earlier = read_status(root)
        self.object: dict[str, Any] = {
            "id": f"batch_{digest[:24]}",
            "object": "batch",
            "endpoint": "",
            "input_file_id": str(requests),
            "completion_window": window or "none",
            "status": "validating",
            "output_file_id": OUTPUT,
            "error_file_id": ERRORS,
            "created_at": earlier.get("created_at", now)
            if earlier.get("id") == f"batch_{digest[:24]}"
            else now,
            "in_progress_at": None,
            "expires_at": None,
            "finalizing_at": None,
            "completed_at": None,
            "failed_at": None,
            "expired_at": None,
            "cancelling_at": None,
            "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "usage": _usage(dict.fromkeys(_USAGE, 0)),
            "errors": None,
            "model": model,
            "metadata": {"output_folder": str(root)},
        }
        self._tokens = dict.fromkeys(_USAGE, 0)
        self._written = 0.0
        self.interval = config.batch_seconds("flush-interval") or 0.0
        self.write()

    # -- steps ------------------------------------------------------------------------------
    def start(
        self, total: int, refused: int, endpoints: list[str], window_seconds: float | None
    ) -> None:
        """The input is read: ``total`` requests, ``refused`` of them refused already."""
        now = int(time.time())
        self.object["endpoint"] = ", ".join(endpoints)
        self.object["status"] = "in_progress"
        self.object["in_progress_at"] = now
        if window_seconds is not None:
            self.object["expires_at"] = now + int(window_seconds)
        self.object["request_counts"] = {"total": total, "completed": 0, "failed": refused}
        self.write()

    def add(self, completed: int, failed: int, tokens: dict[str, int]) -> None:
        """Requests answered and failed since the last call, and their tokens; written at
        most every flush interval."""
        counts = self.object["request_counts"]
        counts["completed"] += completed
        counts["failed"] += failed
        for name in _USAGE:
            self._tokens[name] += tokens.get(name, 0)
        self.object["usage"] = _usage(self._tokens)
        if time.monotonic() - self._written >= self.interval:
            self.write()

    def finish(self, status: str, completed: int, failed: int, usage: dict[str, int]) -> None:
        """The end of the run: its ``status`` and the counts of the files written."""
        now = int(time.time())
        self.object["status"] = status
        self.object[f"{status}_at"] = now
        self.object["finalizing_at"] = self.object["finalizing_at"] or now
        self.object["request_counts"] = {
            "total": completed + failed,
            "completed": completed,
            "failed": failed,
        }
        self.object["usage"] = _usage(usage)
        self.write()

    def fail(self, message: str, line: int | None = None) -> None:
        """The run stopped on an error (refused input, lost cluster): status ``failed``."""
        now = int(time.time())
        self.object["status"] = "failed"
        self.object["failed_at"] = now
        error = {"code": "failed", "message": message, "param": None, "line": line}
        self.object["errors"] = {"object": "list", "data": [error]}
        self.write()

    def cancel(self) -> None:
        """Interrupted (Ctrl-C, SIGTERM): status ``cancelled``; a rerun resumes."""
        now = int(time.time())
        self.object["status"] = "cancelled"
        self.object["cancelling_at"] = self.object["cancelled_at"] = now
        self.write()

    def write(self) -> None:
        """Write the object, once the folder is the batch layer's (its manifest written: a
        folder of someone else's, refused, gets nothing)."""
        if not (self.root / MANIFEST).exists():
            return
        self._written = time.monotonic()
        data = json.dumps(self.object, indent=2) + "\n"
        write_atomically(self.root, self.path, data.encode())


def _usage(tokens: dict[str, int]) -> dict[str, Any]:
    prompt, completion = tokens["prompt_tokens"], tokens["completion_tokens"]
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": tokens["cached_tokens"]},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }
