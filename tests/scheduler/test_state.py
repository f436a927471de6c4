"""The scheduler's state machine per context and worker (dask_pcm.scheduler.state): the
paths reports take, coalesced ones included; illegal transitions refused by Placement.move
and dropped whole by ContextStates.report, which keeps the worker's stream open."""

from __future__ import annotations

import logging

import pytest

from dask_pcm.exceptions import TransitionError
from dask_pcm.protocol import WORKER_TRANSITIONS
from dask_pcm.scheduler.state import TRANSITIONS, ContextStates, Placement

WORKER = "tcp://10.0.0.8:40002"


def _placement() -> Placement:
    return Placement(worker=WORKER, context="smollm2", level="full")


@pytest.mark.parametrize(
    "path",
    [
        ["fetching", "loading", "ready", "evicted", "loading", "ready", "closed"],
        ["ready"],  # fetching, loading and ready coalesced into one report
        ["fetching", "evicted"],  # ready and evicted between two reports
        ["loading", "failed", "closed", "fetching", "ready"],  # a plugin set up again
    ],
)
def test_the_paths_reports_take_are_accepted(path):
    placement = _placement()
    for now, state in enumerate(path, start=1):
        assert placement.move(state, float(now)) is True
    assert [s for s, _ in placement.history] == ["absent", *path]
    assert placement.move(path[-1], 99.0) is False  # staying is no change
    assert placement.since == float(len(path))


@pytest.mark.parametrize(
    ("path", "illegal"),
    [
        (["ready"], "absent"),  # workers never report absent
        (["loading", "failed"], "ready"),  # a failed plugin stays failed until closed
        (["ready"], "fetching"),  # a built context does not copy its template again
        (["ready"], "done"),  # not a state
    ],
)
def test_placement_move_refuses_an_illegal_transition_naming_it(path, illegal):
    placement = _placement()
    for state in path:
        placement.move(state, 1.0)
    with pytest.raises(TransitionError) as info:
        placement.move(illegal, 2.0)
    message = str(info.value)
    assert "'smollm2'" in message and WORKER in message and f"from {path[-1]}" in message
    assert placement.state == path[-1] and len(placement.history) == len(path) + 1


def test_the_scheduler_accepts_every_worker_transition_and_never_a_return_to_absent():
    for state, targets in WORKER_TRANSITIONS.items():
        assert targets <= TRANSITIONS[state]
    assert all("absent" not in targets for targets in TRANSITIONS.values())
    assert TRANSITIONS["failed"] == {"closed"}


def _report(states: ContextStates, state: str, seq: int, **info) -> bool:
    return states.report(WORKER, "smollm2", state, seq, {"level": "full", **info})


def test_an_illegal_report_is_dropped_whole_and_logged_and_later_ones_apply(caplog):
    states = ContextStates()
    states.declare("smollm2", "full", [WORKER])
    assert _report(states, "loading", 1) is True
    assert _report(states, "failed", 2, error="RuntimeError: out of memory") is True
    with caplog.at_level(logging.ERROR, logger="dask_pcm.scheduler.state"):
        assert _report(states, "ready", 3, loads=1, error=None) is False
    assert "Report dropped" in caplog.text and "from failed to ready" in caplog.text
    (row,) = states.rows()
    assert (row["state"], row["loads"], row["error"]) == (
        "failed",
        0,
        "RuntimeError: out of memory",
    )
    assert states.eligible("smollm2") == (set(), "failed")
    assert _report(states, "closed", 4) is True  # the worker plugin removed: legal again
    assert states.rows()[0]["state"] == "closed"
