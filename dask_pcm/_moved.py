"""Old import paths of modules and names that moved, kept for one release.

``import dask_pcm.fever`` (now :mod:`dask_pcm.apps.fever`), ``dask_pcm.loaders.llm`` (now
:mod:`dask_pcm.engine.llm`) and the other names in :data:`MODULES` import the module at its
new place, warn once with a :class:`DeprecationWarning` that names it, and give the same
module object, so that ``dask_pcm.fever.run.run_fever is dask_pcm.apps.fever.run.run_fever``
and what pickles under one name unpickles under the other. :data:`NAMES` does the same for
single names that moved out of a module that stays.

The targets are strings on purpose: the layers below ``dask_pcm.apps`` import nothing of
it; only an old name, when used, reaches up.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Any

#: Old module name -> new module name; a module under an old package moves with it.
MODULES = {
    "dask_pcm.fever.templates": "dask_pcm.apps.fever.prompts",
    "dask_pcm.fever": "dask_pcm.apps.fever",
    "dask_pcm.batch.llm": "dask_pcm.apps.llm",
    "dask_pcm.batch.openai": "dask_pcm.apps.openai_batch",
    "dask_pcm.loaders": "dask_pcm.engine",
    "dask_pcm.deploy.batch": "dask_pcm.deploy.jobqueue",
    "dask_pcm.deploy.start": "dask_pcm.deploy.jobqueue",
    "dask_pcm.scheduler.placement": "dask_pcm.scheduler.steering",
    "dask_pcm.cli_batch": "dask_pcm.cli.openai_batch",
    "dask_pcm.cli_shared": "dask_pcm.cli.shared",
}

#: (old module, name) -> new module holding that name.
NAMES = {
    ("dask_pcm.exceptions", "FeverFormatError"): "dask_pcm.apps.fever.errors",
}

REMOVAL = "the old name goes in dask_pcm 0.3"


def new_name(old: str) -> str | None:
    """Where module ``old`` is now; ``None`` when it did not move."""
    for before, after in MODULES.items():
        if old == before or old.startswith(before + "."):
            return after + old[len(before) :]
    return None


def _warn(old: str, new: str, stacklevel: int) -> None:
    warnings.warn(f"{old} moved to {new}; {REMOVAL}", DeprecationWarning, stacklevel=stacklevel)


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old module name as the module at its new place."""

    def find_spec(
        self, fullname: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        new = new_name(fullname)
        if new is None:
            return None
        # A package answers for its submodules' old names too (``dask_pcm.fever.run``).
        target_spec = importlib.util.find_spec(new)
        if target_spec is None:
            return None
        package = target_spec.submodule_search_locations is not None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=package)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = new_name(spec.name)
        assert new is not None
        _warn(spec.name, new, 3)
        # The import system keeps the module's own __name__ and __spec__ (it sets only
        # those not yet set), so the module answers to its new name everywhere.
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        pass  # already executed under its new name


_FINDER = _Alias()


def install_aliases() -> None:
    """Make the old module names importable (idempotent; ``dask_pcm`` calls it)."""
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.insert(0, _FINDER)


def moved_attribute(module: str, name: str) -> Any:
    """``name`` of ``module``, for a module's ``__getattr__``: the object at its new place,
    with a warning, or the usual :class:`AttributeError`."""
    new = NAMES.get((module, name))
    if new is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    _warn(f"{module}.{name}", f"{new}.{name}", 4)  # at the line that named it
    return getattr(importlib.import_module(new), name)
