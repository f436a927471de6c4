"""The scheduler plugin's pages on the dashboard's HTTP server.

Routes, added to the scheduler's HTTP server (the dashboard's port, 8787 by default) when
:class:`~dask_pcm.scheduler.ContextScheduler` starts and removed when it closes:

- ``/pcm/status.json``: ``{"time", "contexts": {name: summary}, "rows": [status rows],
  "columns", "page_columns"}``; ``rows`` are the rows of :func:`dask_pcm.status` (the
  columns of :class:`dask_pcm.protocol.ContextStatus`, in order).
- ``/pcm/status``: a page of contexts per worker (``status.html``, package data), refreshed
  every two seconds from the JSON route; its table shows :data:`PAGE_COLUMNS`.
"""

from __future__ import annotations

import json
import time
from functools import cache
from importlib import resources
from typing import Any, Protocol

from tornado import web

from dask_pcm.protocol import COLUMNS


class StatusSource(Protocol):
    """What the pages read: :class:`~dask_pcm.scheduler.ContextScheduler` is one (named by
    this protocol, not imported: the plugin imports this module)."""

    scheduler: Any

    def summary(self) -> dict[str, dict[str, Any]]: ...

    def rows(self, contexts: Any = None) -> list[dict[str, Any]]: ...


#: The status columns the page's table shows: (column, heading, how to format it, what it
#: counts: the heading's tooltip).
PAGE_COLUMNS: tuple[tuple[str, str, str, str], ...] = (
    ("worker", "worker", "text", ""),
    ("context", "context", "text", ""),
    ("state", "state", "state", ""),
    ("state_seconds", "for", "seconds", "time in this state"),
    ("loads", "loads", "number", "builds of the context on this worker"),
    ("load_seconds", "load time", "seconds", "time spent building it, all builds"),
    ("tasks", "tasks", "number", "context tasks finished on this worker"),
    ("task_errors", "errors", "number", "of those, tasks that raised"),
    ("evictions", "evictions", "number", "times freed under the memory limit"),
    ("nbytes", "memory", "bytes", "size of the resident context"),
    ("prefix_cache_bytes", "prefixes", "bytes", "kept key/value states of prompt prefixes"),
    ("template_bytes", "template", "bytes", "size of the template (the model files)"),
    ("bytes_from_peers", "from peers", "bytes", "template bytes copied from other workers"),
    ("bytes_from_source", "from source", "bytes", "template bytes read from the source"),
    ("device", "device", "text", ""),
    ("dtype", "dtype", "text", ""),
    ("batch_size", "batch", "number", "prompts per forward pass"),
    ("warning", "warning", "error", ""),
    ("error", "error", "error", ""),
)
_unknown = [c for c, *_ in PAGE_COLUMNS if c not in COLUMNS]
assert not _unknown, f"page columns not in the status record: {_unknown}"


def status_document(plugin: StatusSource) -> dict[str, Any]:
    """The JSON document of ``/pcm/status.json``."""
    return {
        "time": time.time(),
        "contexts": plugin.summary(),
        "rows": plugin.rows(),
        "columns": list(COLUMNS),
        "page_columns": [list(c) for c in PAGE_COLUMNS],
    }


@cache
def _page() -> str:
    return resources.files("dask_pcm.scheduler").joinpath("status.html").read_text()


class _Handler(web.RequestHandler):
    def initialize(self, plugin: StatusSource) -> None:
        self.plugin = plugin


class StatusJSON(_Handler):
    def get(self) -> None:
        self.set_header("Content-Type", "application/json")
        self.set_header("Cache-Control", "no-store")
        self.write(json.dumps(status_document(self.plugin)))


class StatusPage(_Handler):
    def get(self) -> None:
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.write(_page())


def install(plugin: StatusSource) -> web.Application | None:
    """Add the routes to the scheduler's HTTP server; the application to remove later."""
    http = getattr(plugin.scheduler, "http_application", None)
    if http is None:
        return None
    app = web.Application(
        [
            (r"/pcm/status\.json", StatusJSON, {"plugin": plugin}),
            (r"/pcm/status/?", StatusPage, {"plugin": plugin}),
        ]
    )
    http.add_application(app)
    return app


def uninstall(plugin: StatusSource, app: web.Application | None) -> None:
    """Undo :func:`install`."""
    http = getattr(plugin.scheduler, "http_application", None)
    if app is not None and http is not None and app in http.applications:
        http.applications.remove(app)
