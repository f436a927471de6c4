"""Regenerate the benchmark tables in the docs and benchmarks/README.md from the committed JSON.

Usage::

    python benchmarks/report.py           # rewrite every generated block
    python benchmarks/report.py --check   # write nothing; exit 1 naming every stale block

A generated block in a markdown file sits between two marker lines::

    <!-- report:levels -->
    (a table, a blank line, and one line naming the JSON it came from)
    <!-- /report:levels -->

The block's name selects its generator in :data:`GENERATORS`. Only the text between the
markers is rewritten; everything else in the file is left as it is. A marker without its
pair, or a block name with no generator, is an error naming the file and line (exit 2).

Sources: for each benchmark, the newest dated JSON in ``benchmarks/``, either
``<name>-YYYY-MM-DD.json`` or ``runs/YYYY-MM-DD/<name>.json`` (a script's name, ``_`` read
as ``-``); on the same date the file directly in ``benchmarks/`` wins. Every benchmark script
writes the stamped format, ``{"meta": ..., "rows": [...], "summary": ...}``, and every
benchmark's table is built with :func:`load_stamped`, which refuses anything else. :func:`load`
also reads the older format (a list of flat rows; rows with a ``metric`` key are summary rows)
so that the files kept as history, and the application's own JSON (``dask-pcm fever --json``),
stay readable.

Adding a block:

1. Write ``def _name(folder: Path) -> Block``: call ``load_stamped("benchmark", folder)`` for each
   JSON it needs, build the table with :func:`columns_table` (rows and a list of
   :data:`Column`) or :func:`table` (cells you format with :func:`num`, :func:`bold`,
   :func:`span`), and return ``Block(table_text, [loaded, ...])``; the source line under the
   table is written from the loaded files.
2. Register it in :data:`GENERATORS` under the block's name.
3. Put ``<!-- report:name -->`` and ``<!-- /report:name -->`` where the table belongs, run
   this script, and check the result.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

BENCHMARKS = Path(__file__).resolve().parent
REPO = BENCHMARKS.parent
#: Every markdown file with generated blocks (tests/test_report.py checks that no other file
#: in the repository has report markers).
MARKDOWN = (REPO / "docs" / "benchmarks.md", BENCHMARKS / "README.md")

_DATED = re.compile(r"^(?P<name>.+)-(?P<date>\d{4}-\d{2}-\d{2})\.json$")
_RUN_DIR = re.compile(r"^\d{4}-\d{2}-\d{2}$")
_MARKER = re.compile(r"^<!--\s*(?P<close>/?)report:(?P<name>[A-Za-z0-9_.-]+)\s*-->\s*$")


class ReportError(Exception):
    """A JSON file or a markdown file that the report cannot use; the message names it."""


class Loaded(NamedTuple):
    """One benchmark's JSON: its path, ``meta`` (None when not stamped), rows and summary."""

    path: Path
    meta: dict[str, Any] | None
    rows: list[dict[str, Any]]
    summary: Any


class Block(NamedTuple):
    """What a generator returns: the markdown table and the JSON it was built from."""

    table: str
    sources: list[Loaded]


# -- loading --------------------------------------------------------------------------------
def dated_files(name: str, folder: Path = BENCHMARKS) -> list[tuple[str, bool, Path]]:
    """``(date, directly_in_folder, path)`` of every JSON of benchmark ``name``, oldest first."""
    found = []
    for path in folder.glob("*.json"):
        m = _DATED.match(path.name)
        if m and m["name"] == name:
            found.append((m["date"], True, path))
    runs = folder / "runs"
    if runs.is_dir():
        for run in runs.iterdir():
            if not (run.is_dir() and _RUN_DIR.match(run.name)):
                continue
            for path in run.glob("*.json"):
                if path.stem.replace("_", "-") == name:
                    found.append((run.name, False, path))
    return sorted(found)


def newest(name: str, folder: Path = BENCHMARKS) -> Path:
    """The newest dated JSON of benchmark ``name`` (see the module's docstring)."""
    found = dated_files(name, folder)
    if not found:
        raise ReportError(f"{folder}: no {name}-YYYY-MM-DD.json, nor runs/YYYY-MM-DD/{name}.json")
    return found[-1][2]


def load(name: str, folder: Path = BENCHMARKS) -> Loaded:
    """``(path, meta or None, rows, summary)`` of the newest JSON of benchmark ``name``."""
    path = newest(name, folder)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ReportError(f"{path}: {e}") from e
    if isinstance(data, list):
        rows = [r for r in data if isinstance(r, dict) and "metric" not in r]
        summary = [r for r in data if isinstance(r, dict) and "metric" in r]
        return Loaded(path, None, rows, summary)
    if isinstance(data, dict) and {"meta", "rows", "summary"} & data.keys():
        return Loaded(path, data.get("meta"), list(data.get("rows") or []), data.get("summary"))
    raise ReportError(f"{path}: neither a list of rows nor {{meta, rows, summary}}")


def load_stamped(name: str, folder: Path = BENCHMARKS) -> Loaded:
    """:func:`load`, refusing a JSON without ``meta``: every benchmark script writes the
    stamped format, and a table is built only from a run that says what it ran on."""
    src = load(name, folder)
    if src.meta is None:
        raise ReportError(
            f"{src.path}: not stamped (a list of rows, no meta); run the benchmark again and "
            f"commit its JSON as {name}-YYYY-MM-DD.json"
        )
    return src


def _date_of(path: Path) -> str:
    m = _DATED.match(path.name)
    return m["date"] if m else path.parent.name


def _shown(path: Path, root: Path) -> str:
    """``path`` relative to ``root`` where it lies inside it."""
    try:
        return str(path.resolve().relative_to(root.resolve()))
    except ValueError:
        return str(path)


def source_line(sources: Sequence[Loaded], root: Path) -> str:
    """``From `path` (commit, date, repetitions).`` naming every file a table used; files
    without ``meta`` are grouped by date and said to be unstamped once."""

    def shown(path: Path) -> str:
        return f"`{_shown(path, root)}`"

    stamped: list[str] = []
    unstamped: dict[str, list[str]] = {}
    for s in {s.path: s for s in sources}.values():
        if s.meta is None:
            unstamped.setdefault(_date_of(s.path), []).append(shown(s.path))
            continue
        commit = str(s.meta.get("commit") or "unknown")[:7]
        if s.meta.get("dirty"):
            commit += " with uncommitted changes"
        date = str(s.meta.get("date") or _date_of(s.path))[:10]
        reps = s.meta.get("repetitions")
        reps_text = "" if reps is None else f", {reps} repetition{'s' * (reps != 1)}"
        stamped.append(f"{shown(s.path)} (commit {commit}, {date}{reps_text})")
    parts = stamped
    if unstamped:
        groups = "; ".join(f"{', '.join(paths)} ({date})" for date, paths in unstamped.items())
        parts.append(f"{groups}, not stamped (the JSON records no commit)")
    return f"From {'; '.join(parts)}."


# -- formatting -----------------------------------------------------------------------------
DASH = "\N{EN DASH}"
TIMES = "\N{MULTIPLICATION SIGN}"

# A column of a table built from rows: (key in the row, header, format spec). The spec ""
# is text, left-aligned; "r" is text, right-aligned; anything else goes to `format` and is
# right-aligned (".2f", ".0f", "d", ",d").
Column = tuple[str, str, str]


def table(headers: Sequence[str], rows: Iterable[Sequence[str]], align: str) -> str:
    """A markdown table; ``align`` has one letter per column, ``l`` or ``r``."""
    if len(align) != len(headers):
        raise ValueError(f"{len(headers)} headers, {len(align)} alignments")

    def line(cells: Sequence[str]) -> str:
        return "|" + "|".join(f" {c} " if c else " " for c in cells) + "|"

    rule = "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"
    return "\n".join([line(headers), rule, *(line(row) for row in rows)])


def columns_table(rows: Iterable[dict[str, Any]], columns: Sequence[Column]) -> str:
    """A markdown table of ``rows``, one cell per :data:`Column`."""

    def cell(value: Any, spec: str) -> str:
        return str(value) if spec in ("", "r") else format(value, spec)

    body = [[cell(r[key], spec) for key, _, spec in columns] for r in rows]
    align = "".join("l" if spec == "" else "r" for _, _, spec in columns)
    return table([header for _, header, _ in columns], body, align)


def num(x: float, spec: str = ".2f") -> str:
    """``x`` formatted with ``spec`` (``",.0f"`` for thousands separators)."""
    return format(x, spec)


def bold(text: str) -> str:
    return f"**{text}**"


def span(low: float, high: float, spec: str = ".2f") -> str:
    """``low`` and ``high`` joined by an en dash, as in the tables' ranges."""
    return f"{low:{spec}}{DASH}{high:{spec}}"


def minutes(seconds: float) -> str:
    """``"16 min 39 s"``."""
    m, s = divmod(round(seconds), 60)
    return f"{m} min {s} s"


def pick(rows: Iterable[dict[str, Any]], **where: Any) -> dict[str, Any]:
    """The one row whose items include ``where``."""
    found = [r for r in rows if all(r.get(k) == v for k, v in where.items())]
    if len(found) != 1:
        raise ReportError(f"{len(found)} rows where {where}, expected 1")
    return found[0]


class Figure(NamedTuple):
    """A summarised figure: median and 95 % interval over ``n`` repetitions (``_protocol``);
    with one repetition, low and high are the value."""

    median: float
    low: float
    high: float
    n: int


def entry(src: Loaded, **where: Any) -> dict[str, Any]:
    """The one summary entry of a stamped JSON whose items include ``where``."""
    summary = src.summary["intervals"] if isinstance(src.summary, dict) else src.summary
    return pick(summary or [], **where)


def figure(src: Loaded, **where: Any) -> Figure:
    e = entry(src, **where)
    return Figure(e["median"], e["low"], e["high"], e["runs"])


def show(f: Figure, spec: str = ".2f", strong: bool = False) -> str:
    """``1.38 (1.21-1.55)`` (an en dash), the median bold with ``strong``; the median alone
    for one run."""
    median = bold(num(f.median, spec)) if strong else num(f.median, spec)
    return median if f.n < 2 else f"{median} ({span(f.low, f.high, spec)})"


def medians(rows: Iterable[dict[str, Any]], key: str, **where: Any) -> float:
    """The median of ``row[key]`` over the rows (rounds) whose items include ``where``."""
    values = sorted(r[key] for r in rows if all(r.get(k) == v for k, v in where.items()))
    if not values:
        raise ReportError(f"no rows where {where}")
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


# -- generators: one table of one benchmark ---------------------------------------------------
def _source_text(mb_per_s: float | None) -> str:
    return f"{mb_per_s:g} MB/s" if mb_per_s else "no limit"


def _levels(folder: Path) -> Block:
    src = load_stamped("levels", folder)
    settings = sorted({r["source_mb_per_s"] for r in src.rows if r["level"] != "ideal"},
                      key=lambda b: -(b or float("inf")))  # fmt: skip
    body = []
    for mb in [None, *[b for b in settings if b]]:
        for level in ("ideal", "agnostic", "partial", "full", "process-per-task"):
            where = {"level": level, "source_mb_per_s": None if level == "ideal" else mb}
            if level == "ideal" and mb is not None:
                continue
            if not any(all(r.get(k) == v for k, v in where.items()) for r in src.rows):
                continue
            steady = figure(src, metric="seconds", window="steady", level=level,
                            source_mb_per_s=mb)  # fmt: skip
            whole = figure(src, metric="seconds", window="end_to_end", level=level,
                           source_mb_per_s=mb)  # fmt: skip
            body.append([
                level, _source_text(mb), show(steady), show(whole),
                num(medians(src.rows, "loads", **where), ".0f"),
                num(medians(src.rows, "mb_from_source", **where), ",.0f"),
                num(medians(src.rows, "cpu_share", **where)),
            ])  # fmt: skip
    first = table(
        ["level", "source", "steady s", "end-to-end s", "loads", "MB from source", "cpu"],
        body,
        "llrrrrr",
    )
    ratios = []
    for mb in [None, *[b for b in settings if b]]:
        for window in ("steady", "end_to_end"):
            cells = [_source_text(mb), window.replace("_", " ")]
            for metric in ("agnostic_over_full", "partial_over_full",
                           "process-per-task_over_full", "full_efficiency"):  # fmt: skip
                try:
                    f = figure(src, metric=metric, window=window, source_mb_per_s=mb)
                except ReportError:
                    cells.append("")
                    continue
                cells.append(show(f) + ("" if f.n < 2 or f.low > 1 or f.high < 1 else " ~"))
            ratios.append(cells)
    second = table(
        ["source", "window", "agnostic / full", "partial / full", "process-per-task / full",
         "efficiency (ideal / full)"],
        ratios,
        "llrrrr",
    )  # fmt: skip
    return Block(f"{first}\n\n{second}", [src])


def _batch_sizes(folder: Path) -> Block:
    src = load_stamped("batch-sizes", folder)
    body = []
    for level in ("partial", "full", "ideal"):
        for size in sorted({r["batch_size"] for r in src.rows if r["level"] == level}):
            where = {"level": level, "batch_size": size}
            rate = figure(src, metric="claims_per_second", **where)
            eff = "" if level == "ideal" else show(figure(src, metric="efficiency", **where))
            tasks = [
                "" if level == "ideal" else num(medians(src.rows, key, **where))
                for key in ("task_median_seconds", "task_max_seconds")
            ]
            body.append([
                level, str(size), str(pick(src.rows, round=0, **where)["tasks"]),
                show(rate), eff, show(figure(src, metric="share_of_best", **where)), *tasks,
            ])  # fmt: skip
    head = ["level", "batch", "tasks", "claims/s", "efficiency (ideal / level)",
            "share of the level's best", "task median s", "task max s"]  # fmt: skip
    return Block(table(head, body, "lrrrrrrr"), [src])


def _preemption(folder: Path) -> Block:
    src = load_stamped("preemption", folder)
    body = []
    for level in ("full", "partial"):
        for kills in ("seeded", "none"):
            where = {"level": level, "preemption": kills}
            claims = [r["claims_done"] for r in src.rows if r.items() >= where.items()]
            body.append([
                level, "random, seeded" if kills == "seeded" else "none (control)",
                num(medians(src.rows, "preemptions", **where), ".0f"),
                f"{medians(src.rows, 'claims_done', **where):,.0f} "
                f"({min(claims):,}{DASH}{max(claims):,})",
                num(medians(src.rows, "loads", **where), ".0f"),
                str(sum(r["errors"] for r in src.rows if r.items() >= where.items())),
            ])  # fmt: skip
    first = table(
        ["level", "kills", "preemptions", "claims (range)", "loads", "errors"], body, "llrrrr"
    )
    second = table(
        ["figure", "median (95 % interval)"],
        [
            ["full: share of claims lost to preemption",
             show(figure(src, metric="loss_to_preemption", level="full"))],
            ["partial: share of claims lost to preemption",
             show(figure(src, metric="loss_to_preemption", level="partial"))],
            ["claims full / partial, with kills",
             show(figure(src, metric="full_over_partial", kills="seeded"), strong=True)],
            ["claims full / partial, no kills",
             show(figure(src, metric="full_over_partial", kills="none"))],
        ],
        "lr",
    )  # fmt: skip
    return Block(f"{first}\n\n{second}", [src])


SCALE_OUT_SIMULATED: list[Column] = [
    ("n", "N", "d"),
    ("mode", "mode", ""),
    ("seconds", "s until the last holds it", ".2f"),
    ("median_seconds", "median s", ".2f"),
    ("source_gb", "GB from source", ".1f"),
    ("peer_gb", "GB from peers", ".1f"),
    ("max_upload_gb", "GB from the busiest peer", ".1f"),
    ("scheduler_seconds", "directory s (real)", ".2f"),
]


def _scale_out_simulated(folder: Path) -> Block:
    src = load_stamped("scale-out-simulated", folder)
    p2p = {r["n"]: r for r in src.rows if r["mode"] == "p2p"}
    top = max(p2p)
    (a, b), (c, d) = src.rows[0]["fit_p2p"], src.rows[0]["fit_source"]
    facts = table(
        ["figure", "value"],
        [
            [f"p2p, last holder at N={top} / N=8", bold(num(p2p[top]["seconds"] / p2p[8]["seconds"]))],
            [f"p2p, last holder at N={top} / N=1", bold(num(p2p[top]["seconds"] / p2p[1]["seconds"]))],
            ["fit, p2p", f"{a:.2f} + {b:.2f} · log2 N s"],
            ["fit, source alone", f"{c:.2f} + {d:.2f} · N s"],
            [f"busiest peer's uploads at N={top}", f"{p2p[top]['max_upload_gb']:.1f} GB"],
            [f"directory, real scheduler s over the N={top} run", num(p2p[top]["scheduler_seconds"])],
            *([["the whole simulation, real s", num(src.summary["real_seconds"], ".0f")]]
              if "real_seconds" in (src.summary or {}) else []),
        ],
        "lr",
    )  # fmt: skip
    return Block(f"{columns_table(src.rows, SCALE_OUT_SIMULATED)}\n\n{facts}", [src])


def _scale_out(folder: Path) -> Block:
    src = load_stamped("scale-out", folder)
    body = []
    sizes = sorted({r["n"] for r in src.rows})
    for n in sizes:
        for mode in ("source", "p2p"):
            where = {"n": n, "mode": mode}
            held = figure(src, metric="seconds", what="held", **where)
            ready = figure(src, metric="seconds", what="ready", **where)
            ratio = ""
            if mode == "p2p" and n > 1 and 1 in sizes:
                ratio = show(figure(src, metric="p2p_held_over_n1", n=n))
            body.append([
                str(n), mode, show(held), num(medians(src.rows, "held_cpu_floor_seconds", **where)),
                show(ready), ratio,
                num(medians(src.rows, "mb_from_source", **where), ",.0f"),
                num(medians(src.rows, "mb_from_peers", **where), ",.0f"),
            ])  # fmt: skip
    head = ["N", "mode", "held s", "CPU s / cores while held", "ready s", "p2p held / N=1",
            "MB from source", "MB from peers"]  # fmt: skip
    first = table(head, body, "rlrrrrrr")
    ratios = table(
        ["N", "source / p2p, held"],
        [[str(n), show(figure(src, metric="source_over_p2p_held", n=n), strong=n == sizes[-1])]
         for n in sizes],
        "rr",
    )  # fmt: skip
    return Block(f"{first}\n\n{ratios}", [src])


# Parts of the uplinks' time (benchmarks/_scale_out_hosts.py, uplink_profile) in the table.
UPLINK_PARTS = [
    ("busy", "busy, share of their time"),
    ("busy_while_source_reads", "busy while the source was read"),
    ("nothing_wanted", "idle: each chunk they held was held or on its way everywhere"),
    ("wanted_by_full_copies", "idle: lacked only by copies with their window full"),
    ("wanted", "idle: lacked by a copy with a free slot"),
    ("holds_nothing", "idle: holding nothing yet"),
]
# How the downlinks carried the chunks between peers (downlink_profile), in the same table.
DOWNLINK_PARTS = [
    ("busy", "busy (a chunk on its way from a peer), share of their time"),
    ("rate_while_busy", "rate while busy, share of the cap"),
    ("stretch", "a chunk's time over its time at a fair share of the links, median"),
    ("stretch_p90", "the same, 90th percentile"),
]


def _scale_out_hosts(folder: Path) -> Block:
    src = load_stamped("scale-out-hosts", folder)
    link = src.meta["link_mbit_per_s"] if src.meta else float("nan")
    sizes = sorted({r["n"] for r in src.rows if r["mode"] != "single"})
    body = []
    for n in sizes:
        for mode in ("source", "p2p"):
            where = {"n": n, "mode": mode}
            growth = (
                ""
                if n == 1 or 1 not in sizes
                else show(
                    figure(src, metric="held_over_n1", **where),
                    strong=mode == "p2p" and n == sizes[-1],
                )
            )
            body.append([
                str(n), mode, show(figure(src, metric="held_seconds", **where)), growth,
                show(figure(src, metric="held_cpu_share", **where)),
                show(figure(src, metric="seconds", **where)),
                num(medians(src.rows, "mb_from_source", **where), ",.1f"),
                num(medians(src.rows, "mb_from_peers", **where), ",.1f"),
            ])  # fmt: skip
    head = ["N", "mode", "held s", "held / N=1", "CPU share while held", "ready s",
            "MB from source", "MB from peers"]  # fmt: skip
    first = table(head, body, "rlrrrrrr")
    rate, share = (figure(src, metric=m, mode="single") for m in ("mbit_per_s", "of_link"))
    load = (src.meta or {}).get("load_average_during") or [float("nan")]
    # Where the uplinks' time went in the largest p2p broadcast (JSON from 2026-12-07 on).
    profiled = {(e["metric"], e.get("mode")) for e in src.summary if e.get("n") == sizes[-1]}
    uplinks = [
        [f"p2p N={sizes[-1]}: uplinks {what}", show(figure(src, metric=f"uplinks_{part}",
                                                          n=sizes[-1], mode="p2p"))]
        for part, what in UPLINK_PARTS if (f"uplinks_{part}", "p2p") in profiled
    ] + [
        [f"p2p N={sizes[-1]}: downlinks {what}", show(figure(src, metric=f"downlinks_{part}",
                                                            n=sizes[-1], mode="p2p"))]
        for part, what in DOWNLINK_PARTS if (f"downlinks_{part}", "p2p") in profiled
    ]  # fmt: skip
    # The same broadcast simulated on exactly fair links (JSON from 2026-12-07 on).
    if ("held_over_n1", "simulated") in profiled:
        latency = (src.meta or {}).get("simulated_latency_s", float("nan")) * 1e3
        uplinks += [
            [f"simulated on fair links (one-way {latency:g} ms): p2p N={sizes[-1]} / N=1",
             show(figure(src, metric="held_over_n1", n=sizes[-1], mode="simulated"))],
        ] + [
            [f"simulated N={sizes[-1]}: downlinks {what}",
             show(figure(src, metric=f"downlinks_{part}", n=sizes[-1], mode="simulated"))]
            for part, what in DOWNLINK_PARTS if (f"downlinks_{part}", "simulated") in profiled
        ]  # fmt: skip
    facts = table(
        ["figure", "value"],
        [
            [f"one copy between two hosts, Mbit/s (link {link:g})", show(rate, ".1f")],
            ["one copy, share of the link cap", show(share, strong=True)],
            *uplinks,
            ["template MB, chunk", f"{num(src.meta['template_mb'], '.1f')}, {src.meta['chunk']}"]
            if src.meta else ["template", "?"],
            ["1-minute load average at the variants' starts, min to max",
             f"{min(load):.1f}{DASH}{max(load):.1f}"],
        ],
        "lr",
    )  # fmt: skip
    return Block(f"{first}\n\n{facts}", [src])


TRANSFER: list[Column] = [
    ("chunk_mib", "chunk MiB", "d"),
    ("mb_per_s", "MB/s (best of 2)", ".0f"),
    ("first_mb_per_s", "first copy MB/s", ".0f"),
    ("of_loopback", "of raw loopback", ".2f"),
    ("of_verified_loopback", "of verified loopback", ".2f"),
    ("peak_extra_rss_mb", "peak extra RSS MB", ".0f"),
    ("chunks_held", "chunks held", ".1f"),
]


TRANSFER_ROUNDS: list[Column] = [
    ("chunk_mib", "chunk MiB", "d"),
    ("copy", "copy MB/s", ""),
    ("verified", "verified loopback MB/s", ""),
    ("raw", "raw loopback MB/s", ""),
    ("ratio", "copy / verified (paired by round)", ""),
    ("of_medians", "median copy / median verified", ".2f"),
    ("chunks_held", "chunks held, at most", ".1f"),
]


def _scale_out_transfer(folder: Path) -> Block:
    if dated_files("scale-out-copy", folder):  # scale_out.py --quick, copy rounds (issue 43)
        return _scale_out_transfer_rounds(load_stamped("scale-out-copy", folder))
    src = load_stamped("scale-out", folder)
    if "transfer_intervals" in src.summary:
        return _scale_out_transfer_rounds(src)
    # Chunks held is the peak extra memory (MB) in chunks of that size (MiB).
    transfers, loop = src.summary["transfer_alone"], src.summary["loopback"]
    rows = [
        {
            **t,
            "chunks_held": t["peak_extra_rss_mb"] * 1e6 / (t["chunk_mib"] * 2**20),
            "of_loopback": t["mb_per_s"] / loop["loopback_mb_per_s"],
            "of_verified_loopback": t["mb_per_s"] / loop["verified_loopback_mb_per_s"],
        }
        for t in transfers
    ]
    loop_text = (
        f"Loopback socket copy of the same bytes (best of 3, one reused receive buffer): raw "
        f"{loop['loopback_mb_per_s']:,.0f} MB/s, verified (the receiver hashes what it reads) "
        f"{loop['verified_loopback_mb_per_s']:,.0f} MB/s."
    )
    return Block(f"{columns_table(rows, TRANSFER)}\n\n{loop_text}", [src])


def _scale_out_transfer_rounds(src: Loaded) -> Block:
    """The copy and the loopback socket copies interleaved, round by round: medians and
    intervals (``scale_out.py`` since the copy's window adapts)."""
    intervals = src.summary["transfer_intervals"]
    rows = []
    for mib in sorted({e["chunk_mib"] for e in intervals}):

        def get(metric: str, mib: int = mib) -> dict[str, Any]:
            return pick(intervals, metric=metric, chunk_mib=mib)

        def cell(metric: str, spec: str = ",.0f", strong: bool = False) -> str:
            e = get(metric)
            return show(Figure(e["median"], e["low"], e["high"], e["runs"]), spec, strong)

        held = max(
            t["peak_extra_rss_mb"] for t in src.summary["transfer_alone"] if t["chunk_mib"] == mib
        )
        rows.append(
            {
                "chunk_mib": mib,
                "copy": cell("copy_mb_per_s"),
                "verified": cell("verified_loopback_mb_per_s"),
                "raw": cell("raw_loopback_mb_per_s"),
                "ratio": cell("copy_over_verified_loopback", ".2f", strong=True),
                "of_medians": get("copy_over_verified_loopback")["of_medians"],
                "chunks_held": held * 1e6 / (mib * 2**20),
            }
        )
    text = (
        "Each round copies the template once and runs a loopback socket copy of the same "
        "bytes raw and verified (the receiver hashes what it reads, one reused buffer), in "
        "an order drawn per round."
    )
    sizes = sorted({r["n"] for r in src.rows})
    if sizes:
        held = [
            [str(n), show(figure(src, metric="p2p_over_source_held", n=n), strong=True)]
            for n in sizes
        ]
        text += "\n\n" + table(["N (one host)", "p2p / source, held"], held, "rr")
    return Block(f"{columns_table(rows, TRANSFER_ROUNDS)}\n\n{text}", [src])


def _peers(folder: Path) -> Block:
    src = load_stamped("peers", folder)
    body = []
    variants = list(dict.fromkeys(r["variant"] for r in src.rows))
    for v in variants:
        vs = [
            "1" if v == "dask_pcm" else show(figure(src, metric="vs_dask_pcm", window=w, variant=v))
            for w in ("steady", "end_to_end")
        ]
        # The ideal runs every prompt in full: it bounds the prefix variant's time from
        # below no more than a slower algorithm bounds a faster one.
        eff = (
            ""
            if v == "ideal" or v == "dask_pcm-prefix"
            else show(figure(src, metric="efficiency", variant=v))
        )
        body.append([
            v, num(medians(src.rows, "claims_per_s", variant=v)),
            show(figure(src, metric="seconds", window="steady", variant=v)),
            show(figure(src, metric="seconds", window="end_to_end", variant=v)),
            *vs, eff, num(medians(src.rows, "timed_loads", variant=v), ".0f"),
        ])  # fmt: skip
    head = ["variant", "claims/s", "steady s", "end-to-end s", "vs dask_pcm, steady",
            "vs dask_pcm, end to end", "efficiency (ideal / variant)", "loads in the window"]  # fmt: skip
    return Block(table(head, body, "lrrrrrrr"), [src])


def _scheduler_overhead(folder: Path) -> Block:
    src = load_stamped("scheduler-overhead", folder)
    kinds = list(dict.fromkeys(r["kind"] for r in src.rows))
    body = [[k, show(figure(src, metric="tasks_per_second", kind=k), ".0f")] for k in kinds]
    body += [
        [f"{num_} / {den}", show(figure(src, metric=f"{num_}_over_{den}"), strong=True)]
        for num_, den in (("context", "plain"), ("context-restricted", "plain-restricted"))
    ]
    return Block(table(["kind", "tasks/s, or ratio"], body, "lr"), [src])


def _openai_batch(folder: Path) -> Block:
    src = load_stamped("openai-batch", folder)
    prefix, big = src.summary["prefix"], src.summary["big"]

    def shown(i: dict[str, Any], spec: str, strong: bool = False) -> str:
        return show(Figure(i["median"], i["low"], i["high"], i["runs"]), spec, strong)

    n, tokens = prefix["requests"], prefix["system_prompt_tokens"]
    steady = num(big["steady_requests_per_second"], ",.0f")
    body = [
        [f"{n} chats, 9 in 10 share a {tokens}-token system prompt: requests/s, prefixes "
         "found", shown(prefix["found"], ".2f")],
        ["the same, no prefix kept", shown(prefix["none"], ".2f")],
        ["the same requests, every one with the shared prompt", shown(prefix["shared"], ".2f")],
        [f"found / none (target {prefix['target']:g})", shown(prefix["ratio"], ".2f", True)],
        [f"all shared / found (target at most {prefix['target_shared_over_found']:g})",
         shown(prefix["shared_over_found"], ".2f", True)],
        ["greedy text identical, found and none", "yes" if prefix["identical_greedy_text"]
         else "no"],
        [f"{big['requests']:,} requests (tiny model): client peak memory, MB (target "
         f"{big['targets']['client_peak_rss_mb']})", bold(num(big["client_peak_rss_mb"], ".0f"))],
        ["steady requests/s; one process of one thread",
         f"{steady}; {num(big['one_process_requests_per_second'], ',.0f')}"],
        [f"steady / one process (target {big['targets']['rate_ratio']:g})",
         bold(num(big["rate_ratio"], ".2f"))],
    ]  # fmt: skip
    return Block(table(["measure", "median (95 % interval)"], body, "lr"), [src])


PREFIX: list[Column] = [
    ("template", "template", ""),
    ("prompt_tokens", "tokens", ".1f"),
    ("prefix", "prefix", "r"),
    ("run_tokens_without", "run w/o", ".1f"),
    ("run_tokens_with", "run with", ".1f"),
    ("claims_per_second_without", "w/o claims/s", ".2f"),
    ("claims_per_second_with", "with claims/s", ".2f"),
    ("ratio_text", "ratio", "r"),
    ("range", f"min{DASH}max (95 % interval)", "r"),
    ("bound_text", "bound", "r"),
    ("rate_text", "positions/s with / w/o", "r"),
    ("task_ratio", "task ratio", ".2f"),
    ("target_text", "target", ""),
    ("prefix_ms", "prefix ms", ".0f"),
]


def scoring_rows(src: Loaded) -> list[dict[str, Any]]:
    """prefix.py's rows of scoring (all of them before it had a generation section)."""
    return [r for r in src.rows if r.get("section", "logits") == "logits"]


def _prefix(folder: Path) -> Block:
    src = load_stamped("prefix", folder)
    rows = []
    for r in scoring_rows(src):
        target, ratio = r.get("target"), num(r["ratio"])
        low = r.get("target_low")
        goal = (
            "" if target is None else f"≥ {target:g}" + ("" if low is None else f", low ≥ {low:g}")
        )
        rows.append(
            {
                **r,
                "ratio_text": ratio if target is None else bold(ratio),  # a target's ratio
                "range": f"{span(r['ratio_min'], r['ratio_max'])} "
                f"({span(r['ratio_low'], r['ratio_high'])})",
                # Before issue 32 the rows had neither (the per-position rate, the bound).
                "bound_text": num(r["bound"]) if "bound" in r else "",
                "rate_text": num(r["rate_ratio"]) if "rate_ratio" in r else "",
                "target_text": ""
                if target is None
                else f"{goal} {'met' if r['target_met'] else 'missed'}",
            }
        )
    text = columns_table(rows, PREFIX)
    generation = [r for r in src.rows if r.get("section") == "generate"]
    if generation:
        g = generation[0]
        same = "identical" if not g["changed_texts"] else f"{g['changed_texts']} changed"
        text += "\n\n" + table(
            ["generation", "w/o claims/s", "with claims/s", "ratio (95 % interval)", "target",
             "greedy texts"],
            [[
                f"{g['template']}, {g['new_tokens']} new tokens",
                num(g["claims_per_second_without"]), num(g["claims_per_second_with"]),
                f"{bold(num(g['ratio']))} ({span(g['ratio_low'], g['ratio_high'])})",
                f"≥ {g['target']:g} {'met' if g['target_met'] else 'missed'}",
                f"{same} ({g['texts']} per round)",
            ]],
            "lrrrll",
        )  # fmt: skip
    return Block(text, [src])


# startup.py's figures in the order of a run, with what each is (its docstring says more).
_STARTUP = [
    ("cluster_at", "dashboard link printed (cluster started)"),
    ("manifest_seconds", "manifest of the template (client; cached)"),
    ("host_copy_seconds", "template copy by the client while the cluster starts"),
    ("imports_seconds", "`import torch` and `import transformers` (slower worker)"),
    ("copy_seconds", "template copy, until verified (slower worker)"),
    ("from_pretrained_seconds", "`from_pretrained` (slower worker)"),
    ("warm_up_seconds", "warm-up pass (slower worker)"),
    ("first_ready_at", "first worker with the model ready"),
    ("last_ready_at", "last worker with the model ready"),
    ("first_unit_at", "first unit back"),
    ("last_unit_at", "last unit back"),
    ("seconds", "whole command"),
    ("floor_seconds", "floor: a fresh process imports, loads the model, one forward pass"),
]
# The issue's targets (issue 43), as ratios to the floor of the same round: first unit
# back, whole command.
_STARTUP_TARGETS = {"first_unit_at": 1.5, "seconds": 3.0}


def _startup(folder: Path) -> Block:
    src = load_stamped("startup", folder)
    body = []
    for name, what in _STARTUP:
        at = "at" if name.endswith("_at") else "took"
        try:
            shown = show(figure(src, figure=name), ".1f", strong=name in _STARTUP_TARGETS)
        except ReportError:
            shown = "not logged"
        ratio, met = "", ""
        target = _STARTUP_TARGETS.get(name)
        if target is not None:
            over = figure(src, figure=f"{name}_over_floor")
            ratio = show(over, ".2f", strong=True)
            met = f"≤ {target:g} times the floor " + ("met" if over.median <= target else "missed")
        body.append([what, at, shown, ratio, met])
    loads = [r["load_average"] for r in src.rows]
    text = table(["step", "", "seconds", "/ floor", "target"], body, "llrrl")
    text += f"\n\n1-minute load average after each run: {min(loads):.1f}{DASH}{max(loads):.1f}."
    return Block(text, [src])


# The issue's goals for paper_scale.py, as its `goals` states them: requirements, not results.
_PAPER_GOALS = {"ratio": 0.9, "files": 1000, "rss_mb": 600, "recompute_pct": 1.0}


def _paper_scale(folder: Path) -> Block:
    src = load_stamped("paper-scale", folder)
    r, g = src.rows[0], _PAPER_GOALS

    def goal(text: str, met: bool) -> list[str]:
        return [text, "met" if met else "missed"]

    lo, hi = sorted(
        r["steady_units_per_s"] / r[k]
        for k in ("inproc_units_per_s_before", "inproc_units_per_s_after")
    )
    body = [
        [
            f"claims {TIMES} templates = units (tasks)",
            f"{r['claims']:,} {TIMES} {r['templates']} = {r['units']:,} ({r['tasks']:,})",
        ],
        [
            "run_fever, whole call",
            f"{r['seconds']:.0f} s ({minutes(r['seconds'])}), {r['units_per_s']:.1f} units/s",
        ],
        ["steady units/s (first to last-but-one index line)", f"{r['steady_units_per_s']:.1f}"],
        [
            f"in-process units/s, before / after ({r['workers']} processes, "
            f"{r['inproc_sampled_units']:,} sampled units)",
            f"{r['inproc_units_per_s_before']:.1f} / {r['inproc_units_per_s_after']:.1f}",
        ],
        [
            "ratio steady / in-process (mean of both)",
            f"{bold(num(r['ratio']))} ({span(lo, hi)})",
            *goal(f"≥ {g['ratio']:g}", r["ratio"] >= g["ratio"]),
        ],
        [
            f"files in the output (segments of {r['segment_rows']:,} rows)",
            bold(f"{r['files_on_disk']:,}"),
            *goal(f"≤ {g['files']:,}", r["files_on_disk"] <= g["files"]),
        ],
        [
            "peak RSS of the client process (scheduler and nannies in it)",
            bold(f"{r['peak_client_rss_mb']:,.0f} MB")
            + f" (before the run {r['client_rss_before_mb']:,.0f} MB)",
            *goal(f"≤ {g['rss_mb']:,} MB", r["peak_client_rss_mb"] <= g["rss_mb"]),
        ],
        [
            "rows; (template, claim) twice; missing",
            f"{r['rows']:,}; {r['duplicates']:,}; {r['missing']:,}",
        ],
        [
            "kill -9 of the whole CLI run after",
            f"{r['killed_after_seconds']:.0f} s: {r['kill_at_units']:,} units received, "
            f"{r['persisted_at_kill']:,} on disk",
        ],
        [
            "resume: units computed",
            f"{r['resume_computed']:,} in {r['resume_seconds']:.0f} s = unfinished "
            f"({r['units'] - r['persisted_at_kill']:,}) + {r['recomputed_beyond_unfinished']:,}",
        ],
        [
            "finished units the kill lost (computed twice)",
            bold(f"{r['recomputed_twice']:,}") + f" ({r['recompute_pct']:.2f} % of the grid)",
            *goal(f"≤ {g['recompute_pct']:g} %", r["recompute_pct"] <= g["recompute_pct"]),
        ],
        [
            "after the resume: rows; twice; missing",
            f"{r['resume_rows']:,}; {r['resume_duplicates']:,}; {r['resume_missing']:,}",
        ],
    ]
    body = [[*row, "", ""][:4] for row in body]
    return Block(table(["figure", "value", "goal", ""], body, "llll"), [src])


FEVER_ACCURACY: list[Column] = [
    ("template", "template", ""),
    ("accuracy", "accuracy", ".3f"),
    ("macro_f1", "macro-F1", ".3f"),
    ("recall_SUPPORTS", "recall S", ".3f"),
    ("recall_REFUTES", "recall R", ".3f"),
    ("recall_NOT ENOUGH INFO", "recall NEI", ".3f"),
]


def _fever_accuracy(folder: Path) -> Block:
    src = load("fever-accuracy", folder)
    # `dask-pcm fever --json` writes its table as "summary" (and the run as "report").
    text = columns_table(src.rows or src.summary, FEVER_ACCURACY)
    run = json.loads(src.path.read_text()).get("report") or {}
    workers = run.get("workers") or []
    if run and workers:

        def each(key: str, spec: str = "") -> str:
            return " and ".join(format(w[key], spec) for w in workers)

        text += (
            f"\n\n{run['units']['total']:,} work units ({run['claims']:,} claims) in "
            f"{run['wall_seconds']:,.0f} s on {len(workers)} workers: model loads per worker "
            f"{each('loads')} ({each('load_seconds', '.1f')} s), units per worker "
            f"{each('tasks')}."
        )
    return Block(text, [src])


# -- generators: the summaries ----------------------------------------------------------------
# Each figure below is a stamped JSON's summary entry: median and interval over its rounds.
_LEVEL_NAMES = ("agnostic", "partial", "process-per-task")
_PEER_NAMES = {
    "dask-global": "plain Dask + global cache",
    "ray-data": "Ray Data",
    "dask-per-task": "plain Dask loading per task",
}


def level_ratio(lv: Loaded, level: str, limit: float | None) -> Figure:
    """``level``'s steady wall over full's with the source limited to ``limit`` MB/s."""
    return figure(lv, metric=f"{level}_over_full", window="steady", source_mb_per_s=limit)


def _levels_figure(lv: Loaded, limit: float | None, strong: bool) -> str:
    """``agnostic 1.25 (1.10-1.41), ...``: each level's wall over full's, source at ``limit``."""
    return ", ".join(
        f"{lvl} {show(level_ratio(lv, lvl, limit), strong=strong)}" for lvl in _LEVEL_NAMES
    )


def _limit(lv: Loaded) -> float | None:
    """The source limit the summaries quote: 200 MB/s (the design's assumed share of a shared
    filesystem per node) if measured, else the lowest measured; None without one."""
    limits = {r.get("source_mb_per_s") for r in lv.rows} - {None}
    return 200.0 if 200.0 in limits else min(limits, default=None)


def batch_share(bs: Loaded, level: str, size: int) -> Figure:
    """claims/s at ``size`` over the level's best size."""
    return figure(bs, metric="share_of_best", level=level, batch_size=size)


def batch_sizes_of(bs: Loaded) -> list[int]:
    return sorted({r["batch_size"] for r in bs.rows if r["level"] == "full"})


def preemption_ratio(pre: Loaded) -> tuple[Figure, str]:
    """Claims full / partial under preemption, and how the kills came."""
    how = f"random kills, one per {pre.meta['period_s']:g} s on average, {pre.meta['window_s']:g} s"
    return figure(pre, metric="full_over_partial", kills="seeded"), how


def held_ratio(so: Loaded, n: int) -> Figure:
    """Time until all N hold the template: source alone over peer to peer."""
    return figure(so, metric="source_over_p2p_held", n=n)


def ready_seconds(so: Loaded, n: int, mode: str) -> float:
    return float(entry(so, metric="seconds", what="ready", n=n, mode=mode)["median"])


def peer_ratio(peers: Loaded, variant: str) -> Figure:
    """claims/s of ``variant`` over dask_pcm's (steady window)."""
    return figure(peers, metric="vs_dask_pcm", window="steady", variant=variant)


def _peer_figure(peers: Loaded, descending: bool) -> str:
    """``plain Dask + global cache 0.97 (0.90-1.05), ...``: claims/s over dask_pcm's."""
    present = [v for v in _PEER_NAMES if any(r["variant"] == v for r in peers.rows)]
    ranked = sorted(present, key=lambda v: peer_ratio(peers, v).median, reverse=descending)
    return ", ".join(f"{_PEER_NAMES[v]} {show(peer_ratio(peers, v))}" for v in ranked)


def peers_efficiency(peers: Loaded) -> tuple[Figure, float, int]:
    """dask_pcm's efficiency in peers, its claims/s and the claims scored."""
    rows = [r for r in peers.rows if r["variant"] == "dask_pcm"]
    eff = figure(peers, metric="efficiency", variant="dask_pcm")
    return eff, medians(rows, "claims_per_s"), rows[0]["claims"]


def levels_efficiency(lv: Loaded) -> tuple[Figure, int]:
    """Ideal wall / full wall with no source limit, and the claims scored."""
    ideal = next(r for r in lv.rows if r.get("source_mb_per_s") is None and r["level"] == "ideal")
    claims = round(ideal["claims_per_second"] * ideal["wall_seconds"])
    return figure(lv, metric="full_efficiency", window="steady", source_mb_per_s=None), claims


def prefix_ratio(px: Loaded, template: str) -> Figure:
    """claims/s with the template's prefix kept over without, for one built-in template."""
    r = pick(scoring_rows(px), template=template)
    return Figure(r["ratio"], r["ratio_low"], r["ratio_high"], r["repeats"])


def overhead_ratio(ov: Loaded) -> tuple[Figure, float, float]:
    """Context over plain no-op tasks/s, and the two rates."""
    rate = {k: entry(ov, metric="tasks_per_second", kind=k)["median"] for k in ("context", "plain")}
    return figure(ov, metric="context_over_plain"), rate["context"], rate["plain"]


def _summary(folder: Path) -> Block:
    lv, bs, pre, so, peers, ov, px = (
        load_stamped(name, folder)
        for name in ("levels", "batch-sizes", "preemption", "scale-out", "peers",
                     "scheduler-overhead", "prefix")
    )  # fmt: skip
    sizes = batch_sizes_of(bs)
    share_text = "; ".join(
        f"{lvl} " + ", ".join(f"{b}: {show(batch_share(bs, lvl, b))}" for b in sizes)
        for lvl in ("partial", "full")
    )
    pre_ratio, how = preemption_ratio(pre)
    ns = sorted({r["n"] for r in so.rows})
    ready_text = ", ".join(
        f"N={n} {ready_seconds(so, n, 'source'):.1f} → {ready_seconds(so, n, 'p2p'):.1f}"
        for n in ns
    )
    eff, rate, claims = peers_efficiency(peers)
    lv_eff, lv_claims = levels_efficiency(lv)
    ov_ratio, ctx, plain = overhead_ratio(ov)
    limit = _limit(lv)
    body = [
        ["RQ1 levels, no source limit: wall / full", _levels_figure(lv, None, True)],
        *(
            [
                [
                    f"RQ1 levels, shared FS {limit:g} MB/s: wall / full",
                    _levels_figure(lv, limit, True),
                ]
            ]
            if limit
            else []
        ),
        [
            f"RQ2 batch sizes {sizes[0]}{DASH}{sizes[-1]}, claims/s as a share of the level's best",
            share_text,
        ],
        [f"RQ3 preemption ({how}): claims full / partial", show(pre_ratio, strong=True)],
        [
            "RQ4 scale-out, ready s source-only → peer to peer; held source / p2p at the largest N",
            f"{ready_text} ({show(held_ratio(so, ns[-1]), strong=True)})",
        ],
        [f"peers, claims/s against dask_pcm ({rate:.2f})", _peer_figure(peers, descending=True)],
        [
            "efficiency, ideal wall / dask_pcm full wall",
            f"{show(eff, strong=True)} in `peers.py` ({claims} claims), "
            f"{show(lv_eff, strong=True)} in `levels.py` ({lv_claims} claims)",
        ],
        [
            "prompt prefix kept on the workers, claims/s with / without",
            ", ".join(
                f"{t} {show(prefix_ratio(px, t), strong=True)}"
                for t in ("few-shot", "chat-few-shot", "direct")
                if any(r["template"] == t for r in scoring_rows(px))
            ),
        ],
        [
            "scheduler plugin, no-op tasks/s context / plain",
            f"{show(ov_ratio, '.3f', strong=True)} ({ctx:.0f} against {plain:.0f})",
        ],
    ]
    return Block(table(["question", "figure"], body, "ll"), [lv, bs, pre, so, peers, ov, px])


def _headline(folder: Path) -> Block:
    lv, bs, pre, so, sim, peers, px = (
        load_stamped(name, folder)
        for name in ("levels", "batch-sizes", "preemption", "scale-out", "scale-out-simulated",
                     "peers", "prefix")
    )  # fmt: skip
    first = batch_sizes_of(bs)[0]
    pre_ratio, how = preemption_ratio(pre)
    n = max(r["n"] for r in so.rows)
    sim_p2p = {r["n"]: r for r in sim.rows if r["mode"] == "p2p"}
    top = max(sim_p2p)
    eff, _, claims = peers_efficiency(peers)
    lv_eff, lv_claims = levels_efficiency(lv)
    limit = _limit(lv)
    body = [
        ["context levels, wall / full", _levels_figure(lv, None, False)],
        *(
            [
                [
                    f"the same behind a simulated shared filesystem of {limit:g} MB/s",
                    _levels_figure(lv, limit, False),
                ]
            ]
            if limit
            else []
        ),
        [
            f"batch size {first}, claims/s as a share of the level's best",
            f"partial {show(batch_share(bs, 'partial', first))}, "
            f"full {show(batch_share(bs, 'full', first))}",
        ],
        [f"preemption ({how}): claims full / partial", show(pre_ratio)],
        [
            f"{n} workers joining at once: time until all hold the template, source alone / "
            "peer to peer",
            show(held_ratio(so, n)),
        ],
        [
            "simulated with the real protocol, a "
            f"{sim_p2p[top]['template_bytes'] / 1e9:.1f} GB template: time until all hold it, "
            f"{top} workers / 8",
            num(sim_p2p[top]["seconds"] / sim_p2p[8]["seconds"]),
        ],
        [
            f"the same {claims} claims, claims/s against dask_pcm",
            _peer_figure(peers, descending=False),
        ],
        [
            "ideal wall / dask_pcm wall (the ideal: bare processes that load the model once)",
            f"{show(eff)} (peers, {claims} claims), {show(lv_eff)} (levels, {lv_claims} claims)",
        ],
        [
            "prompt prefix kept on the workers, `few-shot` template: claims/s with / without",
            show(prefix_ratio(px, "few-shot")),
        ],
    ]
    return Block(table(["benchmark", "figure"], body, "ll"), [lv, bs, pre, so, sim, peers, px])


# Every benchmark, in the order of benchmarks/README.md, and the script that writes its JSON.
RUNS = {
    "levels": "levels.py",
    "batch-sizes": "batch_sizes.py",
    "preemption": "preemption.py",
    "scale-out": "scale_out.py",
    "scale-out-simulated": "scale_out.py --simulate",
    "scale-out-hosts": "scale_out.py --hosts",
    "scale-out-copy": "scale_out.py --quick",
    "peers": "peers.py",
    "scheduler-overhead": "scheduler_overhead.py",
    "prefix": "prefix.py",
    "paper-scale": "paper_scale.py",
    "startup": "startup.py",
    "openai-batch": "openai_batch.py",
}


def _runs(folder: Path) -> Block:
    """Which run stands behind each benchmark's tables: commit, date, length, load."""
    sources = [load(name, folder) for name in RUNS]
    body, stacks = [], {}
    for script, src in zip(RUNS.values(), sources, strict=True):
        m = src.meta
        if m is None:
            body.append([f"`{script}`", "not stamped", "", "", "", "", ""])
            continue
        commit = str(m.get("commit") or "unknown")[:7] + (" (changed)" if m.get("dirty") else "")
        load_1min = (m.get("load_average_before") or [float("nan")])[0]
        body.append([
            f"`{script}`", commit, str(m.get("date", ""))[:16].replace("T", " "),
            num(m.get("seconds", float("nan")) / 60, ".0f"), str(m.get("repetitions", "")),
            num(load_1min), f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores",
        ])  # fmt: skip
        stack = ", ".join(f"{k} {v}" for k, v in sorted((m.get("versions") or {}).items()))
        stacks.setdefault(stack, []).append(f"`{script.split()[0]}`")
    head = ["script", "commit", "started (UTC)", "minutes", "repetitions",
            "load average before", "CPU"]  # fmt: skip
    text = table(head, body, "lllrrrl")
    if len(stacks) == 1:
        text += f"\n\nStack of every run: {next(iter(stacks))}."
    else:
        text += (
            "\n\nStacks: "
            + "; ".join(
                f"{stack} ({', '.join(dict.fromkeys(scripts))})"
                for stack, scripts in stacks.items()
            )
            + "."
        )
    return Block(text, sources)


Generator = Callable[[Path], Block]

GENERATORS: dict[str, Generator] = {
    "summary": _summary,
    "headline": _headline,
    "levels": _levels,
    "batch-sizes": _batch_sizes,
    "preemption": _preemption,
    "scale-out-simulated": _scale_out_simulated,
    "scale-out": _scale_out,
    "scale-out-transfer": _scale_out_transfer,
    "scale-out-hosts": _scale_out_hosts,
    "peers": _peers,
    "scheduler-overhead": _scheduler_overhead,
    "prefix": _prefix,
    "paper-scale": _paper_scale,
    "startup": _startup,
    "fever-accuracy": _fever_accuracy,
    "openai-batch": _openai_batch,
    "runs": _runs,
}


# -- markdown -------------------------------------------------------------------------------
def blocks(text: str, path: Path) -> list[tuple[str, int, int]]:
    """``(name, first line, last line)`` of each block: the 0-based lines of its markers."""
    found: list[tuple[str, int, int]] = []
    open_: tuple[str, int] | None = None
    for i, line in enumerate(text.splitlines()):
        m = _MARKER.match(line)
        if not m:
            continue
        name = m["name"]
        if not m["close"]:
            if open_ is not None:
                raise ReportError(
                    f"{path}:{i + 1}: report:{name} opens inside report:{open_[0]} "
                    f"(opened at line {open_[1] + 1}, never closed)"
                )
            if name not in GENERATORS:
                raise ReportError(f"{path}:{i + 1}: no generator for block report:{name}")
            open_ = (name, i)
        elif open_ is None or open_[0] != name:
            raise ReportError(f"{path}:{i + 1}: /report:{name} closes no open report:{name}")
        else:
            found.append((name, open_[1], i))
            open_ = None
    if open_ is not None:
        raise ReportError(f"{path}:{open_[1] + 1}: report:{open_[0]} is never closed")
    return found


def render(text: str, path: Path, folder: Path = BENCHMARKS) -> tuple[str, list[str]]:
    """``text`` with every block regenerated, and the names of the blocks that changed."""
    lines = text.splitlines(keepends=True)
    changed = []
    # Back to front, so that earlier line numbers stay valid.
    for name, start, end in reversed(blocks(text, path)):
        try:
            block = GENERATORS[name](folder)
        except (ReportError, KeyError, IndexError, TypeError, ValueError, ZeroDivisionError) as e:
            # Most likely a JSON whose rows no longer have what this generator reads.
            raise ReportError(f"{path}:{start + 1}: report:{name}: {type(e).__name__}: {e}") from e
        body = f"\n{block.table}\n\n{source_line(block.sources, folder.parent)}\n\n"
        if "".join(lines[start + 1 : end]) != body:
            changed.append(name)
            lines[start + 1 : end] = body.splitlines(keepends=True)
    return "".join(lines), changed[::-1]


def regenerate(
    folder: Path = BENCHMARKS, files: Sequence[Path] = MARKDOWN, *, check: bool = False
) -> list[str]:
    """Regenerate the blocks of ``files`` from the JSON in ``folder``; return ``file: block``
    for each block whose text differed. With ``check``, write nothing. Every file is read
    and rendered before any is written, so an error leaves them all as they were."""
    stale: list[str] = []
    new: dict[Path, str] = {}
    for path in files:
        text = path.read_text()
        rendered, changed = render(text, path, folder)
        stale += [f"{_shown(path, REPO)}: {name}" for name in changed]
        if changed:
            new[path] = rendered
    if not check:
        for path, text in new.items():
            path.write_text(text)
    return stale


def check(folder: Path = BENCHMARKS, files: Sequence[Path] = MARKDOWN) -> bool:
    """Whether every block of ``files`` matches what the JSON in ``folder`` gives."""
    return not regenerate(folder, files, check=True)


def main(
    argv: Sequence[str] | None = None,
    folder: Path = BENCHMARKS,
    files: Sequence[Path] = MARKDOWN,
) -> int:
    """The command line: 0 when every block matches (or was rewritten), 1 when ``--check``
    found stale blocks, 2 on an error."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if a block is stale")
    args = p.parse_args(argv)
    try:
        stale = regenerate(folder, files, check=args.check)
    except ReportError as e:
        print(f"report.py: {e}", file=sys.stderr)
        return 2
    if args.check:
        for entry in stale:
            print(f"stale: {entry} (run python benchmarks/report.py)", file=sys.stderr)
        return 1 if stale else 0
    for entry in stale:
        print(f"rewrote {entry}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
