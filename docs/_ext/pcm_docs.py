"""dask_pcm's own Sphinx extension.

- ``pcm-config``: the configuration reference, one ``confval`` per key of
  ``dask_pcm/pcm-schema.yaml`` with its type, its default from ``dask_pcm/pcm.yaml`` and its
  description, grouped by section.
- Links from a page to a repository file outside ``docs/`` (``[...](../benchmarks/README.md)``,
  which is how they read on GitHub) become download links to that file, instead of MyST's
  warning about a document outside the site.
- Docstrings' ``Example`` sections (the house style's singular) read as numpydoc's
  ``Examples``, which numpydoc would otherwise drop with a warning.
- Every name in ``dask_pcm.__all__`` must be documented (the API page): a name missing from it
  is a warning, so an error under ``sphinx-build -W``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml
from docutils import nodes
from docutils.statemachine import StringList
from sphinx import addnodes
from sphinx.application import Sphinx
from sphinx.environment import BuildEnvironment
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles

logger = logging.getLogger(__name__)

PACKAGE = Path(__file__).resolve().parents[2] / "dask_pcm"


def _entries(
    schema: Mapping[str, Any], defaults: Mapping[str, Any], prefix: str
) -> Iterator[tuple[str, Mapping[str, Any], Any]]:
    """``(key, schema entry, default)`` for every key below ``prefix``, sections included,
    in the schema's order."""
    for name, entry in schema["properties"].items():
        key = f"{prefix}.{name}"
        default = defaults.get(name)
        yield key, entry, default
        if entry.get("type") == "object":
            yield from _entries(entry, default or {}, key)


def _type(entry: Mapping[str, Any]) -> str:
    kinds = entry["type"] if isinstance(entry["type"], list) else [entry["type"]]
    text = " or ".join(str(k) for k in kinds)
    if "enum" in entry:
        text += ": " + ", ".join(f"`{v}`" for v in entry["enum"])
    return text


def _default(value: Any) -> str:
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return (
        f"`{'null' if value is None else json.dumps(value) if isinstance(value, list) else value}`"
    )


def config_reference() -> list[str]:
    """The configuration reference as MyST Markdown (the pages' markup): a heading per
    section, a ``confval`` per key."""
    schema = yaml.safe_load((PACKAGE / "pcm-schema.yaml").read_text())
    defaults = yaml.safe_load((PACKAGE / "pcm.yaml").read_text())
    lines: list[str] = []
    for dotted, entry, default in _entries(schema, defaults, ""):
        key = dotted.lstrip(".")
        description = entry["description"].strip().splitlines()
        if entry.get("type") == "object":
            lines += [f"### `{key}`", "", *description, ""]
            continue
        lines += [
            f"```{{confval}} {key}",
            f":type: {_type(entry)}",
            f":default: {_default(default)}",
            "",
            *description,
            "```",
            "",
        ]
    return lines


class ConfigReference(SphinxDirective):
    """``pcm-config``: the configuration reference, generated from the schema."""

    def run(self) -> list[nodes.Node]:
        for name in ("pcm-schema.yaml", "pcm.yaml"):
            self.env.note_dependency(str(PACKAGE / name))
        container = nodes.section()
        container.document = self.state.document
        text = StringList(config_reference(), source=str(PACKAGE / "pcm-schema.yaml"))
        nested_parse_with_titles(self.state, text, container)
        return container.children


def _repository_links(app: Sphinx, doctree: nodes.document) -> None:
    """Turn MyST links to files outside the site into download links (before Sphinx's download
    collector reads the doctree)."""
    env = app.env
    srcdir = Path(app.srcdir).resolve()
    here = (srcdir / env.docname).parent
    for node in list(doctree.findall(addnodes.pending_xref)):
        if node.get("reftype") != "myst" or node.get("refdomain") != "doc":
            continue
        target = Path(node["reftarget"])
        candidates = [target, target.with_name(target.name + ".md")]
        found = [c for c in candidates if c.is_absolute() and c.is_file()]
        if not found or found[0].resolve().is_relative_to(srcdir):
            continue
        download = addnodes.download_reference(
            "",
            "",
            *node.children,
            refdoc=env.docname,
            reftarget=os.path.relpath(found[0], here),
            refexplicit=True,
        )
        node.replace_self(download)


def _examples_section(
    app: Sphinx, what: str, name: str, obj: Any, options: Any, lines: list[str]
) -> None:
    """``Example`` / ``-------`` -> ``Examples`` / ``--------``, before numpydoc parses."""
    for i in range(len(lines) - 1):
        if lines[i].strip() == "Example" and set(lines[i + 1].strip()) == {"-"}:
            indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
            lines[i], lines[i + 1] = f"{indent}Examples", f"{indent}--------"


def _check_api(app: Sphinx, env: BuildEnvironment) -> None:
    import dask_pcm

    documented = set(env.domains.python_domain.objects)
    for name in dask_pcm.__all__:
        if not name.startswith("_") and f"dask_pcm.{name}" not in documented:
            logger.warning(f"dask_pcm.{name} is in dask_pcm.__all__ but not in the API reference")


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("pcm-config", ConfigReference)
    app.connect("doctree-read", _repository_links, priority=400)
    app.connect("env-check-consistency", _check_api)
    # before numpydoc's handler (priority 500) rewrites the docstring
    app.connect("autodoc-process-docstring", _examples_section, priority=400)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
