"""The package's shape stays readable: small modules and classes, no import cycles, the
application on top of the library (see docs/architecture.md; tools/structure.py reports)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parent.parent / "tools" / "structure.py"


def _analysis():
    spec = importlib.util.spec_from_file_location("structure", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules["structure"] = module
    spec.loader.exec_module(module)
    return module.analyse()


ANALYSIS = _analysis()


def test_modules_and_classes_are_small():
    big_modules = {m: n for m, n in ANALYSIS["lines"].items() if n > 400}
    big_classes = {c: n for c, n in ANALYSIS["classes"].items() if n > 250}
    assert big_modules == {} and big_classes == {}


def test_no_import_cycles_among_package_modules():
    assert ANALYSIS["module_level_cycles"] == []
    assert ANALYSIS["cycles"] == []  # imports inside functions included


def test_the_package_never_imports_its_own_top_level():
    """``import dask_pcm`` inside the package ties every module to everything __init__
    re-exports (and made the FEVER application a cycle with it)."""
    users = [m for m, deps in ANALYSIS["edges"].items() if m != "dask_pcm" and "dask_pcm" in deps]
    assert users == []


def test_the_fever_application_sits_on_the_library():
    library = {m for m in ANALYSIS["edges"] if not m.startswith(("dask_pcm.fever", "dask_pcm.cli"))}
    library.discard("dask_pcm")  # __init__ re-exports run_fever
    uses_fever = [
        m for m in library if any(d.startswith("dask_pcm.fever") for d in ANALYSIS["edges"][m])
    ]
    assert uses_fever == []
