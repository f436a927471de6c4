"""benchmarks/report.py: README tables regenerated from dated benchmark JSON."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPORT = Path(__file__).resolve().parents[2] / "benchmarks" / "report.py"
# The benchmark scripts import each other as top-level modules (``_protocol``, ``preemption``).
sys.path.insert(0, str(REPORT.parent))


def _import_report() -> ModuleType:
    spec = importlib.util.spec_from_file_location("report", REPORT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["report"] = module
    spec.loader.exec_module(module)
    return module


report = _import_report()

META = {
    "commit": "1a2b3c4d5e6f7a8b9c0d",
    "dirty": False,
    "date": "2026-12-03T10:00:00Z",
    "cpu": "Test CPU",
    "cores": 2,
    "load_average_before": [0.1, 0.2, 0.3],
    "versions": {"python": "3.12.0"},
    "repetitions": 3,
}


def _write(path: Path, data: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path


def _toy(folder: Path) -> Any:
    """A generator for the tests: one row per JSON row of benchmark ``toy``."""
    src = report.load("toy", folder)
    columns = [("name", "name", ""), ("value", "value", ".2f")]
    return report.Block(report.columns_table(src.rows, columns), [src])


@pytest.fixture
def bench(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A benchmarks folder with one old-format ``toy`` JSON, and the ``toy`` block registered."""
    folder = tmp_path / "benchmarks"
    rows = [{"name": "a", "value": 1.0}, {"name": "b", "value": 2.5}]
    _write(folder / "toy-2026-12-01.json", [*rows, {"metric": "b_over_a", "value": 2.5}])
    monkeypatch.setitem(report.GENERATORS, "toy", _toy)
    return folder


def _markdown(folder: Path, body: str) -> Path:
    path = folder / "README.md"
    path.write_text(
        f"# Title\n\nProse before.\n\n<!-- report:toy -->\n{body}<!-- /report:toy -->\n\nProse after.\n"
    )
    return path


def test_load_reads_the_old_and_the_stamped_format(tmp_path: Path) -> None:
    old = [{"level": "full", "wall_seconds": 2.0}, {"metric": "ratio", "value": 1.5}]
    _write(tmp_path / "old-2026-11-29.json", old)
    stamped = {"meta": META, "rows": [{"level": "full"}], "summary": {"ratio": 1.5}}
    _write(tmp_path / "new-2026-12-03.json", stamped)

    path, meta, rows, summary = report.load("old", tmp_path)
    assert path.name == "old-2026-11-29.json"
    assert meta is None
    assert rows == [{"level": "full", "wall_seconds": 2.0}]
    assert summary == [{"metric": "ratio", "value": 1.5}]

    path, meta, rows, summary = report.load("new", tmp_path)
    assert meta == META and rows == [{"level": "full"}] and summary == {"ratio": 1.5}

    _write(tmp_path / "bad-2026-12-03.json", {"something": "else"})
    with pytest.raises(report.ReportError, match=re.escape("bad-2026-12-03.json")):
        report.load("bad", tmp_path)


def test_the_newest_dated_file_wins(tmp_path: Path) -> None:
    _write(tmp_path / "toy-2026-11-30.json", [{"v": 1}])
    _write(tmp_path / "toy-2026-12-02.json", [{"v": 2}])
    _write(tmp_path / "runs" / "2026-12-01" / "toy.json", [{"v": 3}])
    _write(tmp_path / "toy-extra-2026-12-09.json", [{"v": 4}])  # another benchmark's name
    assert report.load("toy", tmp_path).rows == [{"v": 2}]

    # a run folder's JSON counts under its script's name, `_` read as `-`
    _write(tmp_path / "runs" / "2026-12-05" / "toy.json", [{"v": 5}])
    assert report.load("toy", tmp_path).rows == [{"v": 5}]
    _write(tmp_path / "runs" / "2026-12-05" / "toy_extra.json", [{"v": 6}])
    assert report.load("toy-extra", tmp_path).rows == [{"v": 4}]

    with pytest.raises(report.ReportError, match=re.escape("no missing-YYYY-MM-DD.json")):
        report.load("missing", tmp_path)


def test_regeneration_replaces_the_text_between_the_markers(bench: Path) -> None:
    md = _markdown(bench, "\n| name | value |\n|---|---:|\n| a | 9.99 |\n\nhand-typed\n\n")

    stale = report.regenerate(bench, [md])

    assert [s.rsplit(": ", 1)[1] for s in stale] == ["toy"]
    text = md.read_text()
    assert text.startswith("# Title\n\nProse before.\n\n<!-- report:toy -->\n\n")
    assert text.endswith("\n<!-- /report:toy -->\n\nProse after.\n")
    assert "| a | 1.00 |\n| b | 2.50 |\n" in text
    assert "9.99" not in text and "hand-typed" not in text
    assert (
        "From `benchmarks/toy-2026-12-01.json` (2026-12-01), not stamped (the JSON records no "
        "commit)." in text
    )
    assert report.regenerate(bench, [md]) == []  # nothing left to change


def test_check_fails_on_a_changed_number_and_passes_after_regeneration(bench: Path) -> None:
    md = _markdown(bench, "")
    report.regenerate(bench, [md])
    assert report.check(bench, [md])

    # A new stamped run of the benchmark changes a figure: the committed table is now stale.
    stamped = {"meta": META, "rows": [{"name": "a", "value": 1.25}], "summary": None}
    _write(bench / "toy-2026-12-03.json", stamped)
    before = md.read_text()
    assert not report.check(bench, [md])
    assert md.read_text() == before  # --check writes nothing

    report.regenerate(bench, [md])
    assert report.check(bench, [md])
    text = md.read_text()
    assert "| a | 1.25 |" in text and "| b |" not in text
    assert (
        "From `benchmarks/toy-2026-12-03.json` (commit 1a2b3c4, 2026-12-03, 3 repetitions)." in text
    )

    # and a number edited by hand in the table fails the check again, as the command line
    md.write_text(text.replace("| a | 1.25 |", "| a | 1.26 |"))
    assert not report.check(bench, [md])
    assert report.main(["--check"], bench, [md]) == 1
    assert report.main([], bench, [md]) == 0
    assert report.main(["--check"], bench, [md]) == 0


@pytest.mark.parametrize(
    ("text", "line", "what"),
    [
        ("intro\n\n<!-- report:toy -->\n| a |\n", 3, "never closed"),
        ("intro\n<!-- /report:toy -->\n", 2, "closes no open"),
        ("<!-- report:toy -->\n<!-- report:toy -->\n<!-- /report:toy -->\n", 2, "opens inside"),
        (
            "x\n<!-- report:nothing-makes-this -->\n<!-- /report:nothing-makes-this -->\n",
            2,
            "no generator",
        ),
    ],
)
def test_a_bad_marker_is_an_error_naming_file_and_line(
    bench: Path, text: str, line: int, what: str
) -> None:
    md = bench / "bad.md"
    md.write_text(text)
    with pytest.raises(report.ReportError, match=f"bad.md:{line}: .*{what}"):
        report.regenerate(bench, [md])
    assert md.read_text() == text


def test_a_benchmark_table_needs_a_stamped_json(tmp_path: Path) -> None:
    # The format from before the protocol: a list of rows, one run, no commit.
    rows = [
        {"level": "full", "preemptions": 5, "tasks_done": 53, "claims_done": 424, "errors": 0},
        {"level": "partial", "preemptions": 5, "tasks_done": 40, "claims_done": 320, "errors": 0},
    ]
    old = _write(tmp_path / "runs" / "2026-11-30" / "preemption.json", rows)
    with pytest.raises(report.ReportError, match=f"{re.escape(str(old))}: not stamped"):
        report.GENERATORS["preemption"](tmp_path)

    # The stamped format: rows per round and kill setting, summarised as preemption.py does.
    import preemption

    claims = {("full", "seeded"): [400, 420, 410], ("full", "none"): [500, 520, 505],
              ("partial", "seeded"): [300, 330, 310], ("partial", "none"): [400, 410, 395]}  # fmt: skip
    stamped = [
        {"round": r, "level": level, "preemption": kills, "claims_done": c[r], "errors": 0,
         "loads": 2, "preemptions": 4 if kills == "seeded" else 0}
        for (level, kills), c in claims.items() for r in range(3)
    ]  # fmt: skip
    summary = preemption.summarise(stamped)
    _write(
        tmp_path / "preemption-2026-12-03.json", {"meta": META, "rows": stamped, "summary": summary}
    )
    new = report.GENERATORS["preemption"](tmp_path)
    assert new.sources[0].meta == META
    assert "| full | random, seeded | 4 | 410 (400\u2013420) | 2 | 0 |" in new.table
    ratio = next(
        s for s in summary if s["metric"] == "full_over_partial" and s["kills"] == "seeded"
    )
    shown = f"**{ratio['median']:.2f}** ({ratio['low']:.2f}\u2013{ratio['high']:.2f})"
    assert f"| claims full / partial, with kills | {shown} |" in new.table


def test_the_runs_table_names_the_run_behind_every_benchmark(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(report, "RUNS", {"toy": "toy.py", "other": "other.py --fast"})
    _write(tmp_path / "toy-2026-12-03.json", {"meta": {**META, "seconds": 1500}, "rows": []})
    _write(tmp_path / "other-2026-12-02.json", [{"v": 1}])

    block = report.GENERATORS["runs"](tmp_path)

    lines = block.table.splitlines()
    assert lines[2] == (
        "| `toy.py` | 1a2b3c4 | 2026-12-03 10:00 | 25 | 3 | 0.10 | Test CPU, 2 cores |"
    )
    assert lines[3].startswith("| `other.py --fast` | not stamped |")
    assert lines[-1] == "Stack of every run: python 3.12.0."

    # a run from a tree with uncommitted changes says so, and differing stacks are listed
    changed = {**META, "dirty": True, "versions": {"python": "3.13.1"}}
    _write(tmp_path / "other-2026-12-04.json", {"meta": changed, "rows": []})
    text = report.GENERATORS["runs"](tmp_path).table
    assert "| `other.py --fast` | 1a2b3c4 (changed) |" in text
    assert text.endswith("Stacks: python 3.12.0 (`toy.py`); python 3.13.1 (`other.py`).")


def test_a_json_without_the_generators_fields_is_an_error_naming_the_block(tmp_path: Path) -> None:
    _write(tmp_path / "preemption-2026-12-03.json", {"meta": META, "rows": [{"level": "full"}]})
    md = tmp_path / "README.md"
    md.write_text("intro\n<!-- report:preemption -->\n<!-- /report:preemption -->\n")
    with pytest.raises(
        report.ReportError, match=r"README.md:2: report:preemption: (KeyError|ReportError)"
    ):
        report.regenerate(tmp_path, [md])


def test_every_generated_table_in_the_repository_is_checked() -> None:
    """``report.py --check`` (CI) covers every markdown file with report markers, and the
    committed tables match the committed JSON."""
    repo = REPORT.parent.parent
    marked = set()
    for path in repo.rglob("*.md"):
        parts = path.relative_to(repo).parts
        if any(p.startswith(".") or p in {"_build", "node_modules"} for p in parts):
            continue
        if any(report._MARKER.match(line) for line in path.read_text().splitlines()):
            marked.add(path)
    assert marked == set(report.MARKDOWN)
    assert report.check(), "stale benchmark tables: run python benchmarks/report.py"


def test_the_prefix_block_shows_the_bound_and_the_generation_section(tmp_path: Path) -> None:
    scoring = {
        "template": "few-shot", "prompt_tokens": 83.2, "prefix": "69", "run_tokens_without": 88.8,
        "run_tokens_with": 14.6, "claims_per_second_without": 6.0, "claims_per_second_with": 27.0,
        "ratio": 4.5, "ratio_min": 4.2, "ratio_max": 4.8, "ratio_low": 4.0, "ratio_high": 5.0,
        "bound": 6.08, "rate_ratio": 0.74, "task_ratio": 4.6, "target": 4.0, "target_low": 3.5,
        "target_met": True, "prefix_ms": 300.0, "section": "logits", "repeats": 3,
    }  # fmt: skip
    generation = {
        "template": "few-shot", "section": "generate", "new_tokens": 8, "ratio": 2.4,
        "ratio_low": 2.1, "ratio_high": 2.7, "claims_per_second_without": 2.0,
        "claims_per_second_with": 4.8, "target": 2.0, "target_met": True, "changed_texts": 0,
        "texts": 64, "repeats": 3,
    }  # fmt: skip
    stamped = {"meta": META, "rows": [scoring, generation], "summary": None}
    _write(tmp_path / "prefix-2026-12-03.json", stamped)

    text = report.GENERATORS["prefix"](tmp_path).table

    assert "| few-shot | 83.2 | 69 | 88.8 | 14.6 | 6.00 | 27.00 | **4.50** |" in text
    assert "| 6.08 | 0.74 | 4.60 | ≥ 4, low ≥ 3.5 met | 300 |" in text
    assert "| few-shot, 8 new tokens | 2.00 | 4.80 | **2.40** (2.10\u20132.70) | ≥ 2 met |" in text
    assert "identical (64 per round)" in text
    # The summary's figure is the scoring row's, not the generation's.
    assert report.prefix_ratio(report.load("prefix", tmp_path), "few-shot").median == 4.5
