"""A run's progress in Jupyter: a widget bar, not text lines under a red warning."""

from __future__ import annotations

import nbformat
from nbclient import NotebookClient


def test_a_notebook_shows_the_runs_progress_as_a_widget_without_a_warning(tmp_path):
    """After the README's install, every bar of notebooks/fever-quickstart.ipynb came with
    "TqdmWarning: IProgress not found. Please update jupyter and ipywidgets" and fell back to
    text: ipywidgets was not installed."""
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_code_cell(
            "from dask_pcm.batch.cluster import progress_bar\n"
            "bar = progress_bar(3, True)\n"
            "bar.update(3)\n"
            "bar.close()"
        )
    ]
    NotebookClient(notebook, timeout=120, kernel_name="python3").execute(cwd=str(tmp_path))
    outputs = notebook.cells[0].outputs
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    assert "IProgress not found" not in text and "TqdmWarning" not in text
    widgets = [
        o for o in outputs if "application/vnd.jupyter.widget-view+json" in o.get("data", {})
    ]
    assert widgets, outputs
