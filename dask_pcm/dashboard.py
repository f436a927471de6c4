"""What the scheduler plugin shows: HTTP routes on the dashboard's server and Prometheus.

Routes, added to the scheduler's HTTP server (the dashboard's port, 8787 by default) when
:class:`~dask_pcm.scheduler.ContextScheduler` starts and removed when it closes:

- ``/pcm/status.json``: ``{"time", "contexts": {name: summary}, "rows": [status rows]}``;
  ``rows`` are the rows of :func:`dask_pcm.status` (same columns, same order).
- ``/pcm/status``: a page that shows contexts per worker (state and time in it, load time,
  tasks, device, errors), refreshed every two seconds from the JSON route.

Prometheus (scraped from the scheduler's ``/metrics`` like Dask's own metrics):
``dask_pcm_context_workers{context,state}``, ``dask_pcm_ready_workers{context}``,
``dask_pcm_load_seconds{context}`` (histogram of resident-context load times) and
``dask_pcm_tasks_total{context,worker}`` (context tasks finished per worker).
"""

from __future__ import annotations

import json
import logging
import time
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from tornado import web

if TYPE_CHECKING:
    from dask_pcm.scheduler import ContextScheduler

logger = logging.getLogger(__name__)

LOAD_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

_live: weakref.WeakSet[ContextScheduler] = weakref.WeakSet()
_collector: Any = None


def status_document(plugin: ContextScheduler) -> dict[str, Any]:
    """The JSON document of ``/pcm/status.json``."""
    return {"time": time.time(), "contexts": plugin.summary(), "rows": plugin.rows()}


class _Handler(web.RequestHandler):
    def initialize(self, plugin: ContextScheduler) -> None:
        self.plugin = plugin


class StatusJSON(_Handler):
    def get(self) -> None:
        self.set_header("Content-Type", "application/json")
        self.set_header("Cache-Control", "no-store")
        self.write(json.dumps(status_document(self.plugin)))


class StatusPage(_Handler):
    def get(self) -> None:
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.write(_PAGE)


def install(plugin: ContextScheduler) -> None:
    """Add the routes to the scheduler's HTTP server and the plugin to the metrics."""
    scheduler = plugin.scheduler
    http = getattr(scheduler, "http_application", None)
    if http is not None:
        app = web.Application(
            [
                (r"/pcm/status\.json", StatusJSON, {"plugin": plugin}),
                (r"/pcm/status/?", StatusPage, {"plugin": plugin}),
            ]
        )
        http.add_application(app)
        plugin._http_app = app  # type: ignore[attr-defined]
    _live.add(plugin)
    _register_collector()


def uninstall(plugin: ContextScheduler) -> None:
    """Undo :func:`install`."""
    app = getattr(plugin, "_http_app", None)
    http = getattr(plugin.scheduler, "http_application", None)
    if app is not None and http is not None and app in http.applications:
        http.applications.remove(app)
    _live.discard(plugin)


def _register_collector() -> None:
    global _collector
    if _collector is not None:
        return
    try:
        import prometheus_client
    except ImportError:  # pragma: no cover - a dependency; Dask treats it as optional
        logger.info("prometheus_client is not installed: no dask_pcm metrics")
        return
    _collector = _Collector()
    prometheus_client.REGISTRY.register(_collector)


class _Collector:
    """One collector per process, over every live scheduler plugin in it."""

    def describe(self) -> list[Any]:
        return []  # names are known only when collecting; skip the registry's check

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        states = GaugeMetricFamily(
            "dask_pcm_context_workers",
            "Workers per context and state",
            labels=["context", "state"],
        )
        ready = GaugeMetricFamily(
            "dask_pcm_ready_workers", "Workers where the context is ready", labels=["context"]
        )
        loads = HistogramMetricFamily(
            "dask_pcm_load_seconds",
            "Time to build a resident context (level full) on a worker",
            labels=["context"],
        )
        tasks = CounterMetricFamily(
            "dask_pcm_tasks",
            "Context tasks finished, per worker",
            labels=["context", "worker"],
        )
        for plugin in list(_live):
            for name, by_worker in sorted(plugin.placements.items()):
                counts: dict[str, int] = {}
                for p in by_worker.values():
                    counts[p.state] = counts.get(p.state, 0) + 1
                    tasks.add_metric([name, p.worker], p.tasks)
                for state, n in sorted(counts.items()):
                    states.add_metric([name, state], n)
                ready.add_metric([name], counts.get("ready", 0))
                durations = plugin.load_durations.get(name, [])
                buckets = [(str(b), sum(1 for d in durations if d <= b)) for b in LOAD_BUCKETS] + [
                    ("+Inf", len(durations))
                ]
                loads.add_metric([name], buckets, sum(durations))
        yield from (states, ready, loads, tasks)


_PAGE = r"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>dask_pcm: contexts</title>
<style>
  body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 1.5em;
         color: #222; }
  h1 { font-size: 1.3em; margin-bottom: 0.2em; }
  .sub { color: #666; font-size: 0.9em; margin-bottom: 1em; }
  table { border-collapse: collapse; font-size: 0.9em; margin-bottom: 1.5em; }
  th, td { padding: 4px 10px; border-bottom: 1px solid #ddd; text-align: left; }
  th { background: #f3f3f3; }
  td.num { text-align: right; font-variant-numeric: tabular-nums; }
  .state { padding: 1px 8px; border-radius: 9px; color: white; font-size: 0.85em; }
  .ready { background: #2e9d4e; } .loading, .fetching { background: #d08a1a; }
  .failed { background: #c8372d; } .evicted { background: #7a7a7a; }
  .absent, .closed { background: #aaa; }
  .err { color: #c8372d; max-width: 40em; white-space: pre-wrap; }
</style>
</head>
<body>
<h1>dask_pcm: contexts per worker</h1>
<div class="sub" id="sub">loading...</div>
<table id="summary"><thead><tr><th>context</th><th>level</th><th>workers by state</th>
<th>tasks served</th><th>tasks waiting</th></tr></thead><tbody></tbody></table>
<table id="rows"><thead><tr><th>worker</th><th>context</th><th>state</th><th>for</th>
<th>loads</th><th>load s</th><th>tasks</th><th>errors</th><th>evictions</th><th>memory</th>
<th>device</th><th>batch</th><th>error</th></tr></thead><tbody></tbody></table>
<script>
function esc(s) {
  return String(s == null ? "" : s).replace(/[&<>"]/g,
    c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"}[c]));
}
function bytes(n) {
  if (!n) return "";
  const u = ["B", "KiB", "MiB", "GiB", "TiB"]; let i = 0;
  while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return n.toFixed(i ? 1 : 0) + " " + u[i];
}
function secs(s) { return s < 60 ? s.toFixed(1) + " s" : (s / 60).toFixed(1) + " min"; }
async function refresh() {
  try {
    const doc = await (await fetch(location.pathname.replace(/\/$/, "") + ".json",
                                 {cache: "no-store"})).json();
    const names = Object.keys(doc.contexts);
    document.getElementById("sub").textContent = names.length + " context(s), " +
      new Set(doc.rows.map(r => r.worker)).size + " worker(s); updated " +
      new Date(doc.time * 1000).toLocaleTimeString();
    document.querySelector("#summary tbody").innerHTML = names.map(n => {
      const c = doc.contexts[n];
      const states = Object.entries(c.workers).map(([s, k]) =>
        `<span class="state ${esc(s)}">${esc(s)} ${k}</span>`).join(" ");
      return `<tr><td>${esc(n)}</td><td>${esc(c.level)}</td><td>${states}</td>` +
        `<td class="num">${c.tasks}</td><td class="num">${c.waiting_tasks}</td></tr>`;
    }).join("");
    document.querySelector("#rows tbody").innerHTML = doc.rows.map(r =>
      `<tr><td>${esc(r.worker)}</td><td>${esc(r.context)}</td>` +
      `<td><span class="state ${esc(r.state)}">${esc(r.state)}</span></td>` +
      `<td class="num">${secs(r.state_seconds)}</td><td class="num">${r.loads}</td>` +
      `<td class="num">${r.load_seconds.toFixed(2)}</td><td class="num">${r.tasks}</td>` +
      `<td class="num">${r.task_errors}</td><td class="num">${r.evictions}</td>` +
      `<td class="num">${bytes(r.nbytes)}</td><td>${esc(r.device)}</td>` +
      `<td class="num">${esc(r.batch_size)}</td>` +
      `<td class="err">${esc(r.error)}</td></tr>`).join("");
  } catch (e) {
    document.getElementById("sub").textContent = "scheduler unreachable: " + e;
  }
}
refresh();
setInterval(refresh, 2000);
</script>
</body>
</html>
"""
