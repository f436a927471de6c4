"""Old import paths keep working for one release, with a DeprecationWarning naming the new
place, and give the very objects of the new one (what pickles under one name unpickles under
the other). Each case runs in a fresh interpreter: a module imported once is not imported
(nor warned about) again."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dask_pcm import _moved

CASES = [
    ("dask_pcm.fever.run", "run_fever", "dask_pcm.apps.fever.run"),
    ("dask_pcm.fever", "load_claims", "dask_pcm.apps.fever"),
    ("dask_pcm.fever.templates", "get_templates", "dask_pcm.apps.fever.prompts"),
    ("dask_pcm.batch.llm", "generate", "dask_pcm.apps.llm"),
    ("dask_pcm.batch.openai", "run_requests", "dask_pcm.apps.openai_batch"),
    ("dask_pcm.batch.openai.input", "read_requests", "dask_pcm.apps.openai_batch.input"),
    ("dask_pcm.loaders", "__doc__", "dask_pcm.engine"),
    ("dask_pcm.loaders.llm", "CausalLM", "dask_pcm.engine.llm"),
    ("dask_pcm.deploy.batch", "job_options", "dask_pcm.deploy.jobqueue"),
    ("dask_pcm.deploy.start", "batch_cluster", "dask_pcm.deploy.jobqueue"),
    ("dask_pcm.scheduler.placement", "Steering", "dask_pcm.scheduler.steering"),
    ("dask_pcm.cli_batch", "batch", "dask_pcm.cli.openai_batch"),
    ("dask_pcm.cli_shared", "scheduler_client", "dask_pcm.cli.shared"),
]

PROBE = """
import sys, warnings
warnings.simplefilter("error")  # any other warning fails the probe
old, name, new = sys.argv[1:]
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    old_module = __import__(old, fromlist=[name])
import importlib
new_module = importlib.import_module(new)
assert old_module is new_module, (old_module, new_module)
assert getattr(old_module, name) is getattr(new_module, name)
messages = [str(w.message) for w in seen if w.category is DeprecationWarning]
assert any(old in m and new in m for m in messages), messages
print("ok")
"""


@pytest.mark.parametrize(("old", "name", "new"), CASES)
def test_an_old_import_path_warns_and_gives_the_same_objects(old, name, new):
    out = subprocess.run(
        [sys.executable, "-c", PROBE, old, name, new], capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_every_moved_module_is_tested():
    tested = {_moved.new_name(old) for old, _, _ in CASES}
    assert set(_moved.MODULES.values()) <= tested


def test_a_moved_name_of_a_module_that_stays_warns():
    import dask_pcm.exceptions
    from dask_pcm.apps.fever.errors import FeverFormatError

    with pytest.warns(DeprecationWarning, match="dask_pcm.apps.fever.errors"):
        assert dask_pcm.exceptions.FeverFormatError is FeverFormatError
    with pytest.raises(AttributeError, match="no attribute 'NoSuchError'"):
        dask_pcm.exceptions.NoSuchError  # noqa: B018


def test_the_new_paths_import_without_a_warning():
    code = (
        "import warnings; warnings.simplefilter('error'); "
        "import dask_pcm.apps.fever.run, dask_pcm.apps.llm, dask_pcm.apps.openai_batch, "
        "dask_pcm.engine.llm, dask_pcm.deploy.jobqueue, dask_pcm.scheduler.steering, dask_pcm.cli"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
