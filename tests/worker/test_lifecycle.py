"""A context's state machine on a worker (dask_pcm.worker.lifecycle, levels): the paths each
level takes, illegal transitions refused with the context, worker and both states named,
``closed`` final, and the lifecycle the one writer of the status record."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from dask_pcm import protocol
from dask_pcm.exceptions import TransitionError
from dask_pcm.worker.levels import LEVELS
from dask_pcm.worker.lifecycle import Lifecycle

WORKER = "tcp://10.0.0.7:40001"
WORKER_PACKAGE = Path(protocol.__file__).parent / "worker"


def _life(level: str, start: str) -> tuple[Lifecycle, list[str]]:
    seen: list[str] = []
    life = Lifecycle(WORKER, "smollm2", LEVELS[level], start, template="/models/smollm2")
    life.changed = lambda: seen.append(life.state)
    return life, seen


@pytest.mark.parametrize(
    ("level", "path"),
    [
        # copied, built, kept, evicted under the memory limit, rebuilt, unregistered
        ("full", ["fetching", "loading", "ready", "evicted", "loading", "ready", "closed"]),
        ("full", ["loading", "failed", "closed"]),  # a hub id: built from the source, failed
        ("partial", ["fetching", "ready", "closed"]),  # copied; every task builds
        ("agnostic", ["loading", "ready", "closed"]),  # nothing kept
        ("agnostic", ["loading", "closed"]),  # unregistered while measuring the source
    ],
)
def test_each_level_takes_its_legal_path(level, path):
    life, seen = _life(level, path[0])
    for state in path[1:]:
        assert life.move(state) is True
    assert seen == path[1:]  # every change reported once, in order
    assert life.record().state == "closed" and life.report()["state"] == "closed"


@pytest.mark.parametrize(
    ("level", "start", "steps", "illegal"),
    [
        ("full", "fetching", [], "ready"),  # a resident context is built under "loading"
        ("full", "loading", ["ready"], "fetching"),
        ("full", "loading", ["failed"], "ready"),  # failed stays failed until closed
        ("partial", "fetching", ["ready"], "evicted"),  # nothing resident to evict
        ("partial", "fetching", [], "loading"),
        ("agnostic", "loading", ["ready"], "loading"),
        ("full", "loading", ["ready"], "absent"),  # the scheduler's state, never a worker's
    ],
)
def test_an_illegal_transition_is_refused_naming_context_worker_and_states(
    level, start, steps, illegal
):
    life, seen = _life(level, start)
    for state in steps:
        life.move(state)
    before = life.state
    with pytest.raises(TransitionError) as info:
        life.move(illegal)
    message = str(info.value)
    assert "'smollm2'" in message and WORKER in message
    assert f"from {before} to {illegal} at level {level}" in message
    assert life.state == before and seen == steps  # nothing changed, nothing reported


def test_an_unknown_state_is_refused():
    life, _ = _life("full", "loading")
    with pytest.raises(TransitionError, match="unknown state 'done'"):
        life.move("done")


def test_closed_is_final_and_a_late_change_is_dropped_not_raised():
    """A load thread that finishes after teardown must neither revive the context nor
    crash: closed wins."""
    life, seen = _life("full", "loading")
    assert life.move("closed")
    assert life.move("ready") is False and life.move("failed", "late") is False
    assert life.state == "closed" and life.get("error") is None and seen == ["closed"]


def test_a_conditional_move_changes_only_from_the_states_named():
    life, seen = _life("full", "loading")
    life.move("ready")
    assert life.move("loading", only_from=("evicted",)) is False  # not evicted: no rebuild
    assert life.move("evicted", only_from=("ready",)) is True
    assert life.get("evictions") == 1
    assert life.move("loading", only_from=("evicted",)) is True
    assert seen == ["ready", "evicted", "loading"]


def test_failed_keeps_the_error_and_ready_clears_it():
    life, _ = _life("full", "loading")
    life.move("ready")
    life.move("evicted")
    life.move("loading")
    life.move("failed", "RuntimeError: CUDA out of memory")
    assert life.get("error") == "RuntimeError: CUDA out of memory"
    other, _ = _life("full", "fetching")
    other.update(error="a peer was lost")
    other.move("loading")
    other.move("ready")
    assert other.get("error") is None


def test_fields_change_through_update_and_add_but_never_the_state_or_identity():
    life, seen = _life("partial", "fetching")
    assert life.update(template_bytes=1000) is True
    assert life.update(template_bytes=1000) is False  # no change, no report
    life.add(bytes_from_peers=600, bytes_from_source=400)
    life.add(bytes_from_source=100)
    assert (life.get("bytes_from_peers"), life.get("bytes_from_source")) == (600, 500)
    assert len(seen) == 3
    for field in ("state", "worker", "context", "level", "no_such_field"):
        with pytest.raises(TransitionError, match=field):
            life.update(**{field: "x"})
    copy = life.record()
    copy.state = "ready"  # a copy: the lifecycle's record is untouched
    assert life.state == "fetching"


@pytest.mark.parametrize(
    ("level", "hashed", "hub_id", "none"),
    [
        ("full", True, False, False),
        ("partial", True, True, False),
        ("agnostic", False, False, False),
    ],
)
def test_the_level_table_says_who_copies_the_template(level, hashed, hub_id, none):
    flags = LEVELS[level]
    assert flags.copies_template(has_manifest=True, has_files=True) is hashed
    assert flags.copies_template(has_manifest=False, has_files=True) is hub_id
    assert flags.copies_template(has_manifest=False, has_files=False) is none
    assert flags.resident is (level == "full")
    assert flags.reads_source_per_task is (level == "agnostic")


def _writes_to_a_record(tree: ast.AST) -> list[int]:
    """Lines that assign to an attribute of something named ``record`` or ``_record``, or
    build a ContextStatus."""
    lines = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for target in targets:
            owner = getattr(target, "value", None)
            name = getattr(owner, "attr", getattr(owner, "id", None))
            if isinstance(target, ast.Attribute) and name in ("record", "_record"):
                lines.append(node.lineno)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "ContextStatus":
            lines.append(node.lineno)
    return lines


def test_the_lifecycle_is_the_one_writer_of_the_status_record():
    writers = {
        path.name: lines
        for path in sorted(WORKER_PACKAGE.glob("*.py"))
        if (lines := _writes_to_a_record(ast.parse(path.read_text())))
    }
    assert set(writers) == {"lifecycle.py"}, writers
