"""How a ContextTask travels: pickled once where it is made, shared where it is unpickled."""

from __future__ import annotations

import pickle

from dask_pcm.tasks import ContextTask, uses_context


def test_round_trip_keeps_function_contexts_and_name():
    def double(x: int) -> int:
        return 2 * x

    task = ContextTask(double, ["a", "b"], allow_other_workers=True)
    copy = pickle.loads(pickle.dumps(task))
    assert copy.fn(21) == 42
    assert copy.names == ("a", "b")
    assert copy.allow_other_workers is True
    assert copy.__name__ == "double"


def test_copies_share_one_object_and_resend_the_same_bytes():
    task = uses_context("llm")(lambda claims: len(claims))
    data = pickle.dumps(task)
    first, second = pickle.loads(data), pickle.loads(data)
    assert first is second  # a worker unpickles each distinct task function once
    assert pickle.dumps(first) == data  # the scheduler forwards it without re-pickling fn


def test_each_submission_pickles_the_current_state_of_the_function():
    box = {"threshold": 1}
    task = ContextTask(lambda: box["threshold"], "llm")
    before = pickle.loads(pickle.dumps(task))
    box["threshold"] = 2
    after = pickle.loads(pickle.dumps(task))
    assert (before.fn(), after.fn()) == (1, 2)
