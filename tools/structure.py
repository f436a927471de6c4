"""The package's shape: module sizes, the largest classes, imports inside functions, cycles.

Reads ``dask_pcm/`` as text (nothing is imported) and prints a summary; ``--json`` writes it.
``tests/test_structure.py`` holds the limits this reports on.

    python tools/structure.py [--json structure.json]
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path
from typing import Any

PACKAGE = Path(__file__).resolve().parent.parent / "dask_pcm"


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _targets(
    node: ast.Import | ast.ImportFrom, name: str, path: Path, known: set[str]
) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:  # relative: from the module's package
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        package = package[: len(package) - node.level + 1]
        base = ".".join([*package, base] if base else package)
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]


def analyse(package: Path = PACKAGE) -> dict[str, Any]:
    """Lines per module, lines per class, imports (module level or in functions) and cycles."""
    mods = modules(package)
    known = set(mods)
    lines: dict[str, int] = {}
    classes: dict[str, int] = {}
    edges: dict[str, set[tuple[str, bool]]] = {}
    inner: list[tuple[str, str]] = []
    for name, path in mods.items():
        text = path.read_text()
        tree = ast.parse(text)
        lines[name] = len(text.splitlines())
        deps: set[tuple[str, bool]] = set()

        def visit(
            node: ast.AST,
            in_function: bool,
            name: str = name,
            path: Path = path,
            deps: set[tuple[str, bool]] = deps,
        ) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.ClassDef):
                    classes[f"{name}.{child.name}"] = child.end_lineno - child.lineno + 1  # type: ignore[operator]
                if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                    continue  # not imported at run time
                if isinstance(child, ast.Import | ast.ImportFrom):
                    for target in _targets(child, name, path, known):
                        if in_function:
                            inner.append((name, target))
                        if target in known and target != name:
                            deps.add((target, in_function))
                function = isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
                visit(child, in_function or function)

        visit(tree, False)
        edges[name] = deps
    return {
        "lines": lines,
        "classes": classes,
        "imports_in_functions": inner,
        "edges": {m: sorted(t for t, _ in d) for m, d in edges.items()},
        "cycles": cycles({m: {t for t, _ in d} for m, d in edges.items()}),
        "module_level_cycles": cycles({m: {t for t, f in d if not f} for m, d in edges.items()}),
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the analysis here")
    args = parser.parse_args()
    result = analyse()
    lines, classes = result["lines"], result["classes"]
    print(f"{len(lines)} modules, {sum(lines.values())} lines")
    print("largest modules:")
    for name, n in sorted(lines.items(), key=lambda kv: -kv[1])[:8]:
        print(f"  {n:5d}  {name}")
    print("largest classes:")
    for name, n in sorted(classes.items(), key=lambda kv: -kv[1])[:6]:
        print(f"  {n:5d}  {name}")
    own = [t for _, t in result["imports_in_functions"] if t.startswith("dask_pcm")]
    print(
        f"imports inside functions: {len(result['imports_in_functions'])} ({len(own)} of dask_pcm)"
    )
    print(f"import cycles: {result['cycles'] or 'none'}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    sys.exit(main())
