"""Sphinx configuration of dask_pcm's documentation site.

Build it as CI does (warnings are errors)::

    pip install -c constraints.txt -e ".[docs]"
    sphinx-build -W --keep-going -b html docs docs/_build/html

The pages are Markdown (MyST), so that they read on GitHub too; the API reference comes from
the numpydoc docstrings, the command line from click (sphinx-click) and the configuration
reference from ``dask_pcm/pcm-schema.yaml`` (``_ext/pcm_docs.py``).
"""

from __future__ import annotations

import sys
import warnings
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "_ext"))

project = "dask_pcm"
author = "the dask_pcm developers"
copyright = "the dask_pcm developers"
release = metadata.version("dask-pcm")

extensions = [
    "sphinx.ext.autodoc",
    "numpydoc",
    "sphinx_click",
    "myst_parser",
    "pcm_docs",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build"]

# GitHub's heading anchors (`page.md#a-heading`) work here too.
myst_heading_anchors = 3

# The API reference: members listed by the page, in its order, with their docstrings.
autodoc_member_order = "bysource"
autodoc_typehints = "none"  # the numpydoc sections say the types
numpydoc_show_class_members = False
numpydoc_validation_checks: set[str] = set()
# The house style's "Example" sections are read as "Examples" (_ext/pcm_docs.py); numpydoc
# still warns once per docstring when it looks at the raw text for a signature.
warnings.filterwarnings("ignore", message="Unknown section Example in the docstring")

html_theme = "dask_sphinx_theme"
html_title = f"dask_pcm {release}"
html_static_path: list[str] = []
