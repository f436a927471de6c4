"""run_batch with a function, a context and data that dask_pcm did not write: each case a
user met on the first try (issue 39's table), and what they get now."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

import dask_pcm
from dask_pcm.batch.segments import read_predictions
from dask_pcm.exceptions import BatchInputError, OutputFolderError, UnitError


def _vector_folder(root: Path) -> Path:
    """A template of a user's own: no config.json, a file in a subfolder."""
    (root / "tokenizer").mkdir(parents=True)
    (root / "vectors.faiss").write_bytes(bytes(range(256)) * 64)
    (root / "tokenizer" / "vocab.txt").write_text("alpha\nbeta\ngamma\n")
    return root


def load_vectors(location: str) -> dict[str, object]:
    """A loader of the user's own: reads both files of the copy it is given."""
    folder = Path(location)
    return {
        "size": len((folder / "vectors.faiss").read_bytes()),
        "vocab": (folder / "tokenizer" / "vocab.txt").read_text().split(),
    }


def uses_vectors(rows):
    index = dask_pcm.get_context("vectors")
    return [{"size": index["size"], "words": len(index["vocab"])} for _ in rows]


ROWS = [{"id": i, "text": f"query {i}"} for i in range(12)]


def test_a_folder_of_ones_own_is_a_template(inproc_cluster, tmp_path):
    """It was refused before any work: "model directory ... has no config.json"."""
    _, client = inproc_cluster
    context = dask_pcm.Context(
        "vectors", load_vectors, template=str(_vector_folder(tmp_path / "v"))
    )
    result = dask_pcm.run_batch(
        uses_vectors, ROWS, contexts=context, cluster=client, rows_per_unit=4, progress=False
    )
    out = result.to_pandas()
    assert sorted(out["id"]) == list(range(12))  # in the order units finished
    assert set(out["size"]) == {256 * 64} and set(out["words"]) == {3}


def test_a_changed_file_in_a_subfolder_refuses_the_resume_naming_it(inproc_cluster, tmp_path):
    """The digest came from the Hugging Face file selection, blind to tokenizer/ files: a
    resume kept results made with the old tokenizer."""
    _, client = inproc_cluster
    folder = _vector_folder(tmp_path / "v")
    context = dask_pcm.Context("vectors", load_vectors, template=str(folder))
    options = dict(contexts=context, cluster=client, output=tmp_path / "out", progress=False)
    dask_pcm.run_batch(uses_vectors, ROWS, **options)
    (folder / "tokenizer" / "vocab.txt").write_text("alpha\nbeta\ngamma\ndelta\n")
    with pytest.raises(
        OutputFolderError, match=r"its files changed \(changed: 'tokenizer/vocab.txt'"
    ):
        dask_pcm.run_batch(uses_vectors, ROWS, **options)


def test_the_digest_is_shared_with_the_transport(tmp_path):
    """One identity: the digest a run records is the content of the manifest the workers
    copy by, not a second hash with other rules."""
    from dask_pcm.batch import content_digest
    from dask_pcm.context import template_manifest

    context = dask_pcm.Context(
        "vectors", load_vectors, template=str(_vector_folder(tmp_path / "v"))
    )
    manifest = template_manifest(context)
    assert [f.path for f in manifest.files] == ["tokenizer/vocab.txt", "vectors.faiss"]
    assert content_digest(context) == manifest.content
    assert template_manifest(context) is manifest  # hashed once in this process


def plain(rows, scale=1):
    return [{"double": r["id"] * 2 * scale} for r in rows]


def test_a_function_without_contexts_runs_on_any_worker_and_resumes(inproc_cluster, tmp_path):
    """It raised "a context task needs at least one context name" (contexts=() is the
    default)."""
    _, client = inproc_cluster
    options = dict(cluster=client, rows_per_unit=5, output=tmp_path / "out", progress=False)
    first = dask_pcm.run_batch(plain, ROWS, **options)
    assert first.report["units"]["computed"] == 3
    again = dask_pcm.run_batch(plain, ROWS, **options)
    assert again.report["units"] == {
        "total": 3,
        "computed": 0,
        "reused": 3,
        "failed": 0,
        "unfinished": 0,
    }
    assert list(read_predictions(tmp_path / "out").sort_values("id")["double"]) == [
        2 * i for i in range(12)
    ]


def _module(path: Path, body: str):
    """The module at ``path`` holding ``body``, imported as ``user_tasks`` (a user's file,
    edited between two runs)."""
    path.write_text(body)
    spec = importlib.util.spec_from_file_location("user_tasks", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["user_tasks"] = module
    spec.loader.exec_module(module)
    return module


SCORE = '''
OFFSET = {offset}


def helper(value):
    return value + OFFSET


def score(rows):
    """Score each row."""{comment}
    return [{{"score": helper(r["id"]) * {factor}}} for r in rows]
'''


def test_a_changed_function_refuses_the_resume_naming_it(inproc_cluster, tmp_path):
    """Provenance recorded the function's name only: a fixed bug under the same name was
    answered with the old results."""
    _, client = inproc_cluster
    options = dict(cluster=client, output=tmp_path / "out", progress=False)
    source = tmp_path / "user_tasks.py"
    try:
        first = _module(source, SCORE.format(offset=0, comment="", factor=1))
        dask_pcm.run_batch(first.score, ROWS, **options)
        # A comment and another docstring do not change what it computes: resumed.
        same = _module(source, SCORE.format(offset=0, comment="\n    # why", factor=1))
        same.score.__doc__ = "Another docstring."
        assert dask_pcm.run_batch(same.score, ROWS, **options).report["units"]["computed"] == 0
        fixed = _module(source, SCORE.format(offset=0, comment="", factor=3))
        with pytest.raises(OutputFolderError, match=r"function 'user_tasks.score' changed"):
            dask_pcm.run_batch(fixed.score, ROWS, **options)
        # What it reads from its module counts too: a helper's constant.
        shifted = _module(source, SCORE.format(offset=5, comment="", factor=1))
        with pytest.raises(OutputFolderError, match=r"function 'user_tasks.score' changed"):
            dask_pcm.run_batch(shifted.score, ROWS, **options)
        # The user vouches: the results are kept and the new code recorded.
        kept = dask_pcm.run_batch(fixed.score, ROWS, accept_changes=["function"], **options)
        assert kept.report["units"]["computed"] == 0
        assert dask_pcm.run_batch(fixed.score, ROWS, **options).report["units"]["reused"] == 1
    finally:
        sys.modules.pop("user_tasks", None)


def wrong_ids(rows):
    return [{"id": r["id"] + 100, "n": 1} for r in rows]


def test_rows_returned_with_other_ids_are_the_units_error(inproc_cluster):
    """They were accepted: the output held ids that are in no input row."""
    _, client = inproc_cluster
    with pytest.raises(UnitError, match=r"returned row 1 has id 100 where input row 1 has 0"):
        dask_pcm.run_batch(wrong_ids, ROWS, cluster=client, rows_per_unit=4, progress=False)


def test_a_missing_id_is_refused_at_read_time_with_file_and_line(tmp_path):
    """An id of None was accepted as an id."""
    data = tmp_path / "rows.jsonl"
    lines = [json.dumps({"id": 1, "text": "a"}), "", json.dumps({"id": None, "text": "b"})]
    data.write_text("\n".join(lines) + "\n")
    with pytest.raises(BatchInputError, match=r"rows\.jsonl:3: the id \('id'\) is missing"):
        dask_pcm.run_batch(plain, data, progress=False)


def mixed(rows):
    return [{"value": r["id"] if r["id"] % 2 else f"s{r['id']}"} for r in rows]


def test_a_column_of_mixed_types_is_the_units_error_naming_column_and_rows(inproc_cluster):
    """Arrow's "Expected bytes, got a 'int' object" named neither the column nor the rows."""
    _, client = inproc_cluster
    result = dask_pcm.run_batch(
        mixed, ROWS, cluster=client, rows_per_unit=4, on_error="skip", progress=False
    )
    assert len(result.errors) == 3  # every unit holds both kinds
    message = result.errors["message"].iloc[0]
    assert (
        "column 'value' holds str 's0' in the row with id 0 and int 1 in the row with id 1"
        in message
    )


def test_a_column_whose_type_changes_between_units_is_that_units_error(inproc_cluster, tmp_path):
    """Each unit's rows made a table, but putting them together failed the whole run
    (ArrowTypeError "Unable to merge"), in memory and in an output folder alike."""
    _, client = inproc_cluster
    for output in (None, tmp_path / "out"):
        result = dask_pcm.run_batch(
            mixed, ROWS[:6], cluster=client, rows_per_unit=1, on_error="skip",
            output=output, progress=False,
        )  # fmt: skip
        out = result.to_pandas().sort_values("id")
        kinds = {type(v) for v in out["value"]}
        assert len(kinds) == 1  # one type in the output
        assert len(out) + len(result.errors) == 6  # no row lost
        message = result.errors["message"].iloc[0]
        assert "column 'value' is" in message and "a column takes one type" in message


def _typed_by_flag(rows, flag):
    """Integers, failing from id 6 on, until ``flag`` exists; then strings."""
    if os.path.exists(flag):
        return [{"value": f"s{r['id']}"} for r in rows]
    if any(r["id"] >= 6 for r in rows):
        raise ValueError("not yet")
    return [{"value": r["id"]} for r in rows]


def test_a_resumed_unit_whose_column_type_differs_from_the_folders_is_its_error(
    inproc_cluster, tmp_path
):
    """Units redone on a resume wrote strings beside the folder's integers: the folder could
    no longer be read ("Unable to merge")."""
    _, client = inproc_cluster
    flag = tmp_path / "flag"
    options = dict(cluster=client, rows_per_unit=3, output=tmp_path / "out", on_error="skip")
    first = dask_pcm.run_batch(_typed_by_flag, ROWS, progress=False, flag=str(flag), **options)
    assert first.report["units"]["failed"] == 2
    flag.touch()
    again = dask_pcm.run_batch(_typed_by_flag, ROWS, progress=False, flag=str(flag), **options)
    assert again.report["units"]["failed"] == 2
    assert "in unit the output folder" not in again.errors["message"].iloc[0]
    assert (
        "column 'value' is string here but int64 in the output folder"
        in (again.errors["message"].iloc[0])
    )
    assert list(again.to_pandas().sort_values("id")["value"]) == list(range(6))


@pytest.mark.parametrize("given", ["cluster", "address"])
def test_a_run_on_a_cluster_or_address_closes_the_client_it_made(given, capfd, caplog):
    """A client made for the run was left open: when the user closed the cluster after the
    runs, it tried to reconnect and an asyncio CancelledError traceback was printed."""
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=1, processes=False, dashboard_address=":0") as cluster:
        before = set(Client._instances)
        target = cluster if given == "cluster" else cluster.scheduler_address
        for _ in range(2):
            dask_pcm.run_batch(plain, ROWS, cluster=target, progress=False)
        made = [c for c in Client._instances if c not in before]
        assert made and all(c.status == "closed" for c in made)
        assert cluster.status.name == "running"  # the user's cluster stays
    printed = capfd.readouterr().err + caplog.text
    assert "CancelledError" not in printed and "Traceback" not in printed
