"""The package's shape stays readable: small modules and classes, no import cycles between
modules or packages, layers that import only downward, the application on top of the library
(see docs/architecture.md; tools/structure.py reports). Every import counts, those under
``if TYPE_CHECKING:`` and inside functions included."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "structure.py"


def _tool():
    spec = importlib.util.spec_from_file_location("structure", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules["structure"] = module
    spec.loader.exec_module(module)
    return module


structure = _tool()
ANALYSIS = structure.analyse()


def _reachable(start: str) -> set[str]:
    """Modules imported, directly or through others, by the modules under ``start``."""
    edges = ANALYSIS["edges"]
    todo = [m for m in edges if m == start or m.startswith(start + ".")]
    seen: set[str] = set(todo)
    while todo:
        for target in edges.get(todo.pop(), ()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def _under(modules: set[str], *prefixes: str) -> list[str]:
    return sorted(m for m in modules if any(m == p or m.startswith(p + ".") for p in prefixes))


# Smoke alarms, not targets (docs/style.md, "Rooms, words and history"): a room is sized by
# its subject. A module or class past one says why it is one room in a comment of its
# module that starts with ``# one room:``; code is not cut in half to get under.
MODULE_ALARM, CLASS_ALARM = 600, 350
REASON = "# one room:"


def test_a_module_or_class_past_the_alarm_says_why_it_is_one_room():
    texts = {m: p.read_text() for m, p in structure.modules().items()}
    big_modules = [m for m, n in ANALYSIS["lines"].items() if n > MODULE_ALARM]
    big_classes = [c for c, n in ANALYSIS["classes"].items() if n > CLASS_ALARM]
    owner = {c: c.rsplit(".", 1)[0] for c in big_classes}
    unexplained = [m for m in big_modules if REASON not in texts[m]]
    unexplained += [c for c in big_classes if REASON not in texts[owner[c]]]
    assert unexplained == []


def test_no_import_cycles_among_package_modules():
    assert ANALYSIS["module_level_cycles"] == []
    assert ANALYSIS["cycles"] == []  # imports inside functions and for type checking included


def test_no_import_cycles_between_packages():
    """A package whose modules import another package that imports it back is one layer
    in two folders, however acyclic its modules are."""
    assert ANALYSIS["package_cycles"] == []


def test_the_structure_tool_sees_type_checking_imports_and_package_cycles(tmp_path):
    package = tmp_path / "pkg"
    (package / "a").mkdir(parents=True)
    (package / "b").mkdir()
    for init in ("__init__.py", "a/__init__.py", "b/__init__.py"):
        (package / init).write_text("")
    (package / "a" / "one.py").write_text("from pkg.b import two\n")
    (package / "b" / "two.py").write_text("")
    (package / "b" / "three.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import one\n"
    )
    found = structure.analyse(package)
    assert found["typing_edges"]["pkg.b.three"] == ["pkg.a.one"]
    assert found["cycles"] == []  # no module imports itself back
    assert found["package_cycles"] == [["pkg.a", "pkg.b"]]


def test_the_scheduler_imports_neither_the_worker_side_nor_loaders():
    """The scheduler process needs the protocol and the task marker, not the worker's stack
    (templates, loaders and, through them, torch)."""
    reached = _reachable("dask_pcm.scheduler")
    forbidden = ("dask_pcm.worker", "dask_pcm.engine", "dask_pcm.templates", "dask_pcm.testing")
    assert _under(reached, *forbidden) == []


def test_templates_do_not_import_loaders():
    """The template transport moves files; what builds a context from them sits above it."""
    assert _under(_reachable("dask_pcm.templates"), "dask_pcm.engine", "dask_pcm.worker") == []


def test_no_production_module_imports_the_test_helpers():
    production = [m for m in ANALYSIS["edges"] if not m.startswith("dask_pcm.testing")]
    users = [
        f"{m} -> {t}"
        for m in production
        for t in ANALYSIS["edges"][m]
        if t.startswith("dask_pcm.testing")
    ]
    assert users == []


def test_the_package_never_imports_its_own_top_level():
    """``import dask_pcm`` inside the package ties every module to everything __init__
    re-exports (and made the FEVER application a cycle with it)."""
    users = [m for m, deps in ANALYSIS["edges"].items() if m != "dask_pcm" and "dask_pcm" in deps]
    assert users == []


APPS = ("dask_pcm.apps", "dask_pcm.cli")
#: Above the core: the applications, the command line, the package's own top level (which
#: re-exports run_fever lazily) and the table of old import paths.
ABOVE_THE_CORE = (*APPS, "dask_pcm._moved")


def _in(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def _core() -> list[str]:
    return [m for m in ANALYSIS["edges"] if m != "dask_pcm" and not _in(m, *ABOVE_THE_CORE)]


def test_the_core_imports_nothing_of_the_applications():
    """Everything below ``dask_pcm.apps`` (the batch layer, the engine, the plugins, the
    transport, the deployments) knows no application: FEVER, OpenAI Batch files and the
    built-in LLM tasks stand on it."""
    users = [f"{m} -> {t}" for m in _core() for t in ANALYSIS["edges"][m] if _in(t, *APPS)]
    assert users == []


def test_the_batch_layer_imports_no_engine():
    """The batch layer runs any function against any context: it imports neither the
    inference engine nor what it loads (only the context API, which names a default loader)."""
    batch = [m for m in ANALYSIS["edges"] if _in(m, "dask_pcm.batch")]
    users = [
        f"{m} -> {t}"
        for m in batch
        for t in ANALYSIS["edges"][m]
        if _in(t, "dask_pcm.engine", "dask_pcm.apps")
    ]
    assert users == []


#: Names that are an interface another program calls by name, not a name of ours.
INTERFACES = {"dask_setup", "dask_teardown", "main"}


def test_no_public_name_is_defined_twice():
    """One name, one thing: a public function or class is defined in one module (the
    command line's commands are named as their commands and are exempt)."""
    where: dict[str, list[str]] = {}
    for module, names in ANALYSIS["definitions"].items():
        if module.startswith("dask_pcm.cli"):
            continue
        for name in names:
            if not name.startswith("_") and name not in INTERFACES:
                where.setdefault(name, []).append(module)
    assert {n: ms for n, ms in where.items() if len(ms) > 1} == {}


def test_importing_dask_pcm_on_a_worker_loads_no_application_nor_batch_system():
    """Every worker and the scheduler import dask_pcm: the FEVER app, the batch layer,
    dask-jobqueue and the test helpers load only when a client uses them."""
    code = (
        "import sys, dask_pcm; "
        "print(sorted(m for m in ('dask_pcm.apps.fever', 'dask_pcm.batch', 'dask_pcm.testing', "
        "'dask_pcm.cli', 'dask_jobqueue') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_every_public_name_resolves_lazily_loaded_ones_included():
    import dask_pcm
    from dask_pcm import run_fever
    from dask_pcm.apps.fever.run import run_fever as defined

    assert run_fever is defined and dask_pcm.run_fever is defined
    missing = [name for name in dask_pcm.__all__ if not hasattr(dask_pcm, name)]
    assert missing == []
    assert set(dask_pcm.__all__) <= set(dir(dask_pcm))
    with pytest.raises(AttributeError, match="no attribute 'run_fevr'"):
        dask_pcm.run_fevr  # noqa: B018


def _layer_table_file() -> Path:
    found = [p for p in sorted((ROOT / "docs").rglob("*.md")) if structure.BEGIN in p.read_text()]
    assert len(found) == 1, f"one page of docs/ holds the layer table, found {found}"
    return found[0]


def test_the_layer_table_in_the_docs_is_what_the_imports_say():
    """docs/architecture.md's table of who imports whom is generated from the imports:
    after changing them, run ``python tools/structure.py --layers <that page>``."""
    page = _layer_table_file()
    text = page.read_text()
    assert structure.with_layer_table(text, structure.layer_table(ANALYSIS), page) == text
