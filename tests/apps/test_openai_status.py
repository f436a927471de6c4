"""``DIR/batch.json``, the Batch object of an OpenAI Batch file's run: its status while the run
goes and at the end, counts that add up, the usage of the answers, ``--status``, and the
completion window (requests not run by then are ``batch_expired``; a rerun answers them)."""

from __future__ import annotations

import contextlib
import json
import threading
import time

import dask
import pytest
from click.testing import CliRunner
from openai.types import Batch

from dask_pcm.apps.openai_batch import parse_window, run_requests
from dask_pcm.cli import main

CHAT = "/v1/chat/completions"


def requests_file(path, n, max_tokens=4, bad=()):
    lines = []
    for i in range(n):
        body = {"messages": [{"role": "user", "content": f"Question {i}"}],
                "max_tokens": max_tokens, "temperature": 0}  # fmt: skip
        if i in bad:
            body["temperature"] = 9
        lines.append(
            json.dumps({"custom_id": f"r{i}", "method": "POST", "url": CHAT, "body": body})
        )
    path.write_text("\n".join(lines) + "\n")
    return path


def lines_of(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_batch_object_while_the_run_goes_and_at_its_end(
    inproc_cluster, tiny_model_dir, tmp_path
):
    _, client = inproc_cluster
    path = requests_file(tmp_path / "requests.jsonl", 48, max_tokens=12, bad={5, 17})
    out = tmp_path / "out"
    seen, stop = [], threading.Event()

    def watch():
        while not stop.is_set():
            with contextlib.suppress(OSError, ValueError):
                seen.append(json.loads((out / "batch.json").read_text()))
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with dask.config.set({"pcm.batch.flush-interval": 0}):  # written at every unit
            outcome = run_requests(path, out, model=tiny_model_dir, cluster=client,
                                   progress=False, requests_per_unit=4)  # fmt: skip
    finally:
        stop.set()
        watcher.join()
    final = Batch.model_validate_json((out / "batch.json").read_text())
    assert final.status == "completed" and outcome.status == "completed"
    assert final.request_counts.model_dump() == {"total": 48, "completed": 46, "failed": 2}
    assert final.in_progress_at <= final.completed_at and final.created_at <= final.in_progress_at
    answers = lines_of(out / "output.jsonl")
    usage = [a["response"]["body"]["usage"] for a in answers]
    assert final.usage.input_tokens == sum(u["prompt_tokens"] for u in usage)
    assert final.usage.output_tokens == sum(u["completion_tokens"] for u in usage) == 46 * 12
    assert final.usage.total_tokens == final.usage.input_tokens + final.usage.output_tokens
    assert final.output_file_id == "output.jsonl" and final.error_file_id == "errors.jsonl"
    # While it ran: in progress, with counts that grow and never pass the total.
    running = [s for s in seen if s["status"] == "in_progress"]
    assert running, [s["status"] for s in seen]
    done = [s["request_counts"]["completed"] for s in running]
    assert done == sorted(done) and any(0 < d < 46 for d in done)
    assert all(s["request_counts"]["completed"] + s["request_counts"]["failed"] <= 48
               for s in running)  # fmt: skip
    # --status prints it; a rerun keeps its id and creation time.
    printed = CliRunner().invoke(main, ["batch", "--status", str(out)])
    assert printed.exit_code == 0 and json.loads(printed.output)["id"] == final.id
    run_requests(path, out, model=tiny_model_dir, cluster=client, progress=False,
                 requests_per_unit=4)  # fmt: skip
    again = Batch.model_validate_json((out / "batch.json").read_text())
    assert (again.id, again.created_at) == (final.id, final.created_at)
    assert again.request_counts == final.request_counts and again.usage == final.usage


@pytest.mark.soak  # 240 requests, run twice: among the slowest; CI runs it after the README's command
def test_requests_past_the_completion_window_expire_and_a_rerun_answers_them(
    inproc_cluster, tiny_model_dir, tmp_path
):
    _, client = inproc_cluster
    # Enough requests that 2 s cannot answer them all on a fast, warm host (60 were answered
    # in time once; a third of them is usual here).
    n = 240
    path = requests_file(tmp_path / "requests.jsonl", n, max_tokens=48)
    out = tmp_path / "out"
    args = dict(model=tiny_model_dir, cluster=client, progress=False, requests_per_unit=2)
    first = run_requests(path, out, completion_window="2s", **args)
    status = Batch.model_validate_json((out / "batch.json").read_text())
    assert first.status == status.status == "expired" and status.expired_at is not None
    errors = lines_of(out / "errors.jsonl")
    assert 0 < len(errors) < n and first.succeeded + len(errors) == n
    assert all(e["response"] is None and e["error"]["code"] == "batch_expired" for e in errors)
    assert status.request_counts.completed == first.succeeded
    second = run_requests(path, out, **args)
    assert (second.succeeded, second.failed, second.status) == (n, 0, "completed")
    assert (out / "errors.jsonl").read_text() == ""
    assert len(lines_of(out / "output.jsonl")) == n


def test_completion_windows_are_read_as_openai_writes_them():
    assert parse_window("24h") == 86400 and parse_window("90m") == 5400
    assert parse_window("30s") == parse_window(30) == 30 and parse_window("none") is None
    for bad in ("soon", "0h", "-3"):
        try:
            parse_window(bad)
        except ValueError as exc:
            assert repr(bad) in str(exc)
        else:
            raise AssertionError(bad)
    result = CliRunner().invoke(main, ["batch", "-i", __file__, "-o", "x", "--completion-window",
                                       "soon"])  # fmt: skip
    assert result.exit_code == 2 and "--completion-window" in result.output
