"""dask_pcm's page inside Dask's Bokeh dashboard: "More..." → "Pcm Contexts".

Dask's dashboard builds its Bokeh pages, and the "More..." menu from their routes, once, when
the scheduler starts, from ``distributed.dashboard.scheduler.applications``; pages whose
route starts with ``/individual-`` are listed in that menu. distributed documents no other
way to add a page, and its top navigation is a fixed list, so the page is added to that
mapping *before* a scheduler starts, by the scheduler preload
:mod:`dask_pcm.scheduler.preload` (which :func:`dask_pcm.local_cluster` and
:func:`dask_pcm.batch_cluster` pass to their schedulers; ``dask scheduler --preload
dask_pcm.scheduler.preload`` elsewhere). A scheduler started without it still serves
``/pcm/status`` (:mod:`dask_pcm.scheduler.dashboard`) once a context is registered; that page
links to Dask's pages and here.

The page shows what ``/pcm/status`` shows, refreshed every second: per context the workers by
state and its tasks (done, queued or running, waiting for a ready worker), and a table of
contexts per worker. Bokeh is imported only when the page is drawn.
"""

from __future__ import annotations

import html
import json
from typing import Any

from dask_pcm.protocol import READY, STATE_COLOURS
from dask_pcm.scheduler.dashboard import PAGE_COLUMNS
from dask_pcm.scheduler.plugin import PLUGIN_NAME

ROUTE = "/individual-pcm-contexts"

# A state as a coloured badge, in Bokeh's cell template language.
_STATE_CELL = (
    '<span style="color: white; padding: 0 6px; border-radius: 8px; background: '
    f"<%= ({json.dumps(STATE_COLOURS)})[value] || '#aaaaaa' %>\"><%= value %></span>"
)


def add_to_dashboard() -> bool:
    """Add the page to the dashboards of schedulers started from now on in this process;
    ``False`` where Dask serves no dashboard (Bokeh missing)."""
    try:
        from distributed.dashboard import scheduler as dashboard
    except ImportError:
        return False
    dashboard.applications.setdefault(ROUTE, contexts_doc)
    return True


def contexts_doc(scheduler: Any, extra: dict[str, Any], doc: Any) -> None:
    """Build the page for one browser session (called by Dask's Bokeh server)."""
    from bokeh.layouts import column
    from bokeh.models.sources import ColumnDataSource
    from bokeh.models.widgets.markups import Div
    from bokeh.models.widgets.tables import DataTable, HTMLTemplateFormatter, TableColumn

    source = ColumnDataSource({name: [] for name, *_ in PAGE_COLUMNS})
    columns = []
    for name, label, kind, _ in PAGE_COLUMNS:
        column_options: dict[str, Any] = {"field": name, "title": label}
        if kind == "state":
            column_options["formatter"] = HTMLTemplateFormatter(template=_STATE_CELL)
        columns.append(TableColumn(**column_options))
    table = DataTable(
        source=source, columns=columns, sizing_mode="stretch_both", index_position=None
    )
    summary = Div(sizing_mode="stretch_width")

    def update() -> None:
        plugin = scheduler.plugins.get(PLUGIN_NAME)
        rows = plugin.rows() if plugin is not None else []
        source.data = {
            name: [_cell(r.get(name), kind) for r in rows] for name, _, kind, _ in PAGE_COLUMNS
        }
        summary.text = _summary_html(plugin.summary() if plugin is not None else {})

    update()
    doc.add_periodic_callback(update, 1000)
    doc.add_root(column(summary, table, sizing_mode="stretch_both"))
    doc.title = "Dask: PCM contexts"


def _cell(value: Any, kind: str) -> Any:
    if value is None:
        return ""
    if kind == "bytes":
        return _bytes(int(value)) if value else ""
    if kind == "seconds":
        return f"{float(value):.1f} s"
    return value


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _summary_html(contexts: dict[str, dict[str, Any]]) -> str:
    head = (
        '<p style="font-size: 0.9em"><b>dask_pcm contexts</b> · '
        '<a href="pcm/status">full page</a> · <a href="status">Dask status</a></p>'
    )
    if not contexts:
        return head + "<p>No context registered yet (dask_pcm.register).</p>"
    lines = []
    for name, c in contexts.items():
        states = " ".join(
            f'<span style="color: {STATE_COLOURS.get(s, "#777")}">{html.escape(s)} {k}</span>'
            for s, k in sorted(c["workers"].items(), key=lambda sk: sk[0] != READY)
        )
        lines.append(
            f"<tr><td><b>{html.escape(name)}</b></td><td>{html.escape(str(c['level']))}</td>"
            f"<td>{states}</td><td>{c['tasks']}</td><td>{c['pending_tasks']}</td>"
            f"<td>{c['waiting_tasks']}</td></tr>"
        )
    return (
        head + '<table style="font-size: 0.9em"><tr><th>context</th><th>level</th><th>workers</th>'
        "<th>tasks done</th><th>queued or running</th><th>waiting for a ready worker</th></tr>"
        + "".join(lines)
        + "</table>"
    )
