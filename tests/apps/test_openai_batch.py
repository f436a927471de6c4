"""``dask-pcm batch``: OpenAI Batch API files (dask_pcm.apps.openai_batch) on the tiny random Llama,
the responses checked with the official ``openai`` package's models."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from openai.types import Batch, Completion, CreateEmbeddingResponse, ErrorObject
from openai.types.chat import ChatCompletion

from dask_pcm import client as pcm
from dask_pcm.apps.openai_batch import read_requests
from dask_pcm.cli import main
from dask_pcm.exceptions import BatchInputError
from tests.conftest import cluster_client

CHAT, COMPLETIONS, EMBEDDINGS = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"
MODELS = {CHAT: ChatCompletion, COMPLETIONS: Completion, EMBEDDINGS: CreateEmbeddingResponse}
TEXTS = ["Paris is the capital of", "Water boils at", "The Moon is", "Marie Curie won"]
MALFORMED = ['{"custom_id": "broken", "method": "POST"', "[1, 2, 3]", '{"method": "POST"}']


def request(i: int) -> dict:
    """Request ``i`` of the mixed file: chats, completions and embeddings, greedy or sampled;
    every 50th asks for something this runner does not do."""
    text = TEXTS[i % len(TEXTS)] + f" {i}"
    kind = i % 3
    if i % 50 == 7:
        return {"custom_id": f"r{i}", "method": "POST", "url": "/v1/images/generations",
                "body": {"prompt": text}}  # fmt: skip
    if kind == 0:
        body = {"model": "any", "messages": [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": text}], "max_tokens": 3}  # fmt: skip
        body.update({"temperature": 0} if i % 2 else {"temperature": 0.9, "seed": i})
        return {"custom_id": f"r{i}", "method": "POST", "url": CHAT, "body": body}
    if kind == 1:
        body = {"model": "any", "prompt": text, "max_tokens": 2 + i % 3, "temperature": 0}
        if i % 4 == 1:
            body["stop"] = ["\n", "zz"]
        return {"custom_id": f"r{i}", "method": "POST", "url": COMPLETIONS, "body": body}
    inputs = text if i % 2 else [text, TEXTS[0]]
    return {"custom_id": f"r{i}", "method": "POST", "url": EMBEDDINGS,
            "body": {"model": "any", "input": inputs}}  # fmt: skip


def write_requests(path: Path, requests: list[dict], malformed: list[str] = ()) -> Path:
    """``requests`` as a file, ``malformed`` lines at lines 11, 51, 91..."""
    lines = [json.dumps(r) for r in requests]
    for n, line in enumerate(malformed):
        lines.insert(10 + 40 * n, line)
    path.write_text("\n".join(lines) + "\n")
    return path


def lines_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_mixed_file_is_answered_once_each_in_the_batch_apis_format(tiny_model_dir, tmp_path):
    requests = [request(i) for i in range(197)]
    # A prompt too long for the model (the rest of its unit is answered), two choices asked
    # for, a temperature out of range.
    long = {"model": "any", "prompt": "Long. " * 3000, "max_tokens": 2, "temperature": 0}
    requests.insert(5, {"custom_id": "long", "method": "POST", "url": COMPLETIONS, "body": long})
    requests.append({"custom_id": "tools", "method": "POST", "url": CHAT,
                     "body": {"messages": [{"role": "user", "content": "Hi"}],
                              "tools": [{"type": "function"}]}})  # fmt: skip
    requests.append({"custom_id": "hot", "method": "POST", "url": COMPLETIONS,
                     "body": {"prompt": "Hi", "temperature": 7}})  # fmt: skip
    path = write_requests(tmp_path / "requests.jsonl", requests, MALFORMED)
    out = tmp_path / "answers"
    args = ["batch", "-i", str(path), "-o", str(out), "--model", str(tiny_model_dir)]
    args += ["--workers", "1", "--errors", "skip", "--requests-per-unit", "16", "--any-model"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output

    answers, errors = lines_of(out / "output.jsonl"), lines_of(out / "errors.jsonl")
    refused = {r["custom_id"] for r in requests if r["url"] not in MODELS}
    refused |= {"long", "tools", "hot"}
    assert [a["custom_id"] for a in answers] == [
        r["custom_id"] for r in requests if r["custom_id"] not in refused
    ]  # each once, in input order
    assert [e["custom_id"] for e in errors] == [
        r["custom_id"] for r in requests if r["custom_id"] in refused
    ]
    summary = f"{len(answers)} succeeded, {len(errors)} failed, 3 skipped line(s); answers in "
    assert summary + f"{out / 'output.jsonl'}, errors in {out / 'errors.jsonl'}" in result.output
    assert f"{path}:11: invalid JSON" in result.output

    by_id = {r["custom_id"]: r for r in requests}
    for line in answers:
        assert set(line) == {"id", "custom_id", "response", "error"} and line["error"] is None
        assert line["id"].startswith("batch_req_")
        response = line["response"]
        assert response["status_code"] == 200 and response["request_id"].startswith("req_")
        sent = by_id[line["custom_id"]]
        parsed = MODELS[sent["url"]].model_validate(response["body"])
        assert parsed.model == "tiny-llama"
        if sent["url"] == EMBEDDINGS:
            given = sent["body"]["input"]
            assert len(parsed.data) == (1 if isinstance(given, str) else len(given))
            assert {len(d.embedding) for d in parsed.data} == {64}  # the tiny model's width
            assert parsed.usage.prompt_tokens == parsed.usage.total_tokens > 0
        else:
            (choice,) = parsed.choices
            assert choice.finish_reason in ("stop", "length")
            usage = parsed.usage
            assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
            assert 0 <= usage.completion_tokens <= sent["body"]["max_tokens"]
    # Request failures as OpenAI writes them: HTTP answers with an error body.
    for e in errors:
        assert e["error"] is None and e["response"]["status_code"] == 400
        assert e["response"]["request_id"].startswith("req_")
    bodies = {e["custom_id"]: ErrorObject.model_validate(e["response"]["body"]["error"])
              for e in errors}  # fmt: skip
    assert {i: (b.code, b.param) for i, b in bodies.items()} == {
        **{r["custom_id"]: ("unsupported_url", None) for r in requests if r["url"] not in MODELS},
        "long": ("context_length_exceeded", "prompt"),
        "tools": ("unsupported_parameter", "tools"),
        "hot": ("invalid_value", "temperature"),
    }
    assert all(b.type == "invalid_request_error" and b.message for b in bodies.values())
    # The model as the user gave it, not the worker's copy in its scratch folder.
    too_long = bodies["long"].message
    assert f"cannot run on model {tiny_model_dir}" in too_long and "pcm-templates" not in too_long

    # A rerun finds every unit done: the same two files, written again, and no warning about
    # them in the folder.
    before = [(out / n).read_bytes() for n in ("output.jsonl", "errors.jsonl")]
    again = CliRunner().invoke(main, args)
    assert again.exit_code == 0, again.output
    assert [(out / n).read_bytes() for n in ("output.jsonl", "errors.jsonl")] == before
    assert "did not write" not in again.output


def test_bad_lines_and_duplicate_ids_are_refused_before_any_work(tmp_path):
    path = write_requests(tmp_path / "requests.jsonl", [request(i) for i in range(30)], MALFORMED)
    out = tmp_path / "answers"
    result = CliRunner().invoke(main, ["batch", "-i", str(path), "-o", str(out)])
    assert result.exit_code == 1
    assert f"{path}:11: invalid JSON" in result.output and "--errors skip" in result.output
    assert "Traceback" not in result.output and not out.exists()

    write_requests(path, [request(i) for i in range(30)])
    with open(path, "a") as f:
        f.write(json.dumps(request(4)) + "\n")
    for errors in ("raise", "skip"):
        args = ["batch", "-i", str(path), "-o", str(out), "--errors", errors]
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 1
        assert f"{path}:31: custom_id 'r4' is already used on line 5" in result.output
        assert not out.exists()


def one(url: str, body: dict, method: str = "POST") -> dict:
    return {"custom_id": "a", "method": method, "url": url, "body": body}


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (one(CHAT, {}, method="GET"), "unsupported_method"),
        (one(COMPLETIONS, {"prompt": [[1, 2], [3]]}), "unsupported_value"),
        (one(COMPLETIONS, {"prompt": "a", "logprobs": 9}), "invalid_value"),
        (one(CHAT, {"messages": [{"role": "user"}], "top_logprobs": 2}), "invalid_value"),
        (one(CHAT, {"messages": [{"content": "no role"}]}), "invalid_value"),
        (
            one(CHAT, {"messages": [{"role": "user"}], "response_format": {"type": "xml"}}),
            "invalid_value",
        ),
        (one(EMBEDDINGS, {"input": "a", "encoding_format": "int8"}), "invalid_value"),
        (one(EMBEDDINGS, {"input": "a", "dimensions": 0}), "invalid_value"),
        (one(COMPLETIONS, {"prompt": "a", "max_tokens": 0}), "invalid_value"),
        (one("/v1/responses", {"input": [{"type": "function_call_output"}]}), "unsupported_value"),
        (one(CHAT, {"model": "gpt-4o-mini", "messages": [{"role": "user"}]}), "model_not_found"),
    ],
)
def test_requests_that_cannot_run_here_are_request_errors(tmp_path, line, expected):
    path = tmp_path / "requests.jsonl"
    path.write_text(json.dumps(line) + "\n")
    (item,) = read_requests(path, model="tiny").items
    assert item.row is None and item.error.code == expected
    assert item.error.status == (404 if expected == "model_not_found" else 400)
    (answered,) = read_requests(path, model="tiny", any_model=True).items
    assert (answered.error is None) == (expected == "model_not_found")


def test_chat_parts_and_defaults_make_a_row(tmp_path):
    parts = [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]
    body = {"model": "gpt", "messages": [{"role": "user", "content": parts}], "logprobs": False,
            "max_completion_tokens": 5, "stop": "."}  # fmt: skip
    path = tmp_path / "requests.jsonl"
    path.write_text("\ufeff" + json.dumps({"custom_id": "a", "method": "post", "url": CHAT,
                                           "body": body}) + "\n\n")  # fmt: skip
    (item,) = read_requests(path).items
    params = json.loads(item.row.pop("params"))
    assert item.row == {
        "custom_id": "a",
        "endpoint": "chat",
        "messages": [{"role": "user", "content": "Hello there"}],
    }
    assert params == {"max_tokens": 5, "temperature": 1.0, "top_p": 1.0, "seed": None,
                      "stop": ".", "n": 1, "logprobs": None, "json_schema": None}  # fmt: skip
    path.write_text('{"custom_id": "b", "method": "POST", "url": 3, "body": {}}\n')
    with pytest.raises(BatchInputError, match=rf"{path}:1: request 'b': 'url' is missing"):
        read_requests(path)


def test_a_running_scheduler_keeps_the_model_between_runs(tiny_model_dir, tmp_path):
    requests = write_requests(tmp_path / "requests.jsonl", [request(i) for i in range(12)])
    with cluster_client(processes=True) as client:
        scheduler_file = tmp_path / "scheduler.json"
        client.write_scheduler_file(str(scheduler_file))
        args = ["batch", "-i", str(requests), "--model", str(tiny_model_dir), "--any-model"]
        for run, option in enumerate([["--scheduler-file", str(scheduler_file)],
                                      ["--scheduler", client.scheduler.address]]):  # fmt: skip
            result = CliRunner().invoke(main, [*args, *option, "-o", str(tmp_path / f"{run}")])
            assert result.exit_code == 0, result.output
            assert "11 succeeded, 1 failed, 0 skipped line(s)" in result.output
        (row,) = pcm.status(client).itertuples()
        assert (row.context, row.loads, row.tasks) == ("openai-batch-llm", 1, 2)
        args += ["-o", str(tmp_path / "x"), "--scheduler", client.scheduler.address]
        clash = CliRunner().invoke(main, [*args, "--workers", "2"])
        assert clash.exit_code == 2 and "drop --workers" in clash.output


@pytest.mark.slow
@pytest.mark.soak  # a run killed part way, then run again
def test_a_run_killed_midway_then_run_again_answers_each_request_once(tiny_model_dir, tmp_path):
    path = tmp_path / "requests.jsonl"
    requests = [
        {"custom_id": f"r{i}", "method": "POST", "url": COMPLETIONS,
         "body": {"prompt": f"{TEXTS[i % 4]} {i}", "max_tokens": 24, "temperature": 0}}
        for i in range(40)
    ]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in requests))
    out = tmp_path / "answers"
    cmd = [sys.executable, "-m", "dask_pcm.cli", "batch", "-i", str(path), "-o", str(out)]
    cmd += ["--model", str(tiny_model_dir), "--workers", "1", "--requests-per-unit", "1"]
    env = {**os.environ, "DASK_PCM__BATCH__FLUSH_INTERVAL": "0"}  # every unit on disk at once
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    first = subprocess.Popen(cmd, env=env, start_new_session=True, **quiet)
    groups = [first.pid]
    try:
        written = 0
        deadline = time.monotonic() + 180
        while written < 3:
            assert first.poll() is None, "the first run ended before it could be killed"
            assert time.monotonic() < deadline, "no unit written in time"
            time.sleep(0.05)
            written = len(indexed_units(out))
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        kill_group(first.pid)  # its worker processes, orphaned
        assert 3 <= len(indexed_units(out)) < 40
        assert not (out / "output.jsonl").exists()
        # The Batch object as the kill left it: in progress, part of the requests counted.
        killed = Batch.model_validate_json((out / "batch.json").read_text())
        assert killed.status == "in_progress" and killed.request_counts.total == 40
        assert 0 < killed.request_counts.completed < 40 and killed.completed_at is None

        second = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)  # fmt: skip
        groups.append(second.pid)
        output, _ = second.communicate(timeout=240)
        assert second.returncode == 0, output
    finally:
        for pid in groups:
            kill_group(pid)
    assert "40 succeeded, 0 failed, 0 skipped" in output
    final = Batch.model_validate_json((out / "batch.json").read_text())
    assert final.status == "completed" and final.id == killed.id
    assert final.request_counts.model_dump() == {"total": 40, "completed": 40, "failed": 0}
    assert final.usage.output_tokens == 40 * 24
    answers = lines_of(out / "output.jsonl")
    assert [a["custom_id"] for a in answers] == [r["custom_id"] for r in requests]
    assert (out / "errors.jsonl").read_text() == ""
    units = indexed_units(out)
    assert len(units) == len(set(units)) == 40  # no unit written twice


def indexed_units(out: Path) -> list[str]:
    index = out / "_dask_pcm_index.jsonl"
    if not index.exists():
        return []
    units = []
    for line in index.read_text().splitlines():
        with contextlib.suppress(ValueError):  # a line being appended
            units += list(json.loads(line)["units"])
    return units


def kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def test_the_requests_of_a_failed_unit_say_why_in_the_errors_file(tmp_path):
    """A unit that failed (a timeout, a crash) is named by the batch layer with its rows'
    ids: each of its requests gets that reason in errors.jsonl, the others their answers'
    absence, without cutting the file into units a second time."""
    from dask_pcm.apps.openai_batch.output import write_results
    from dask_pcm.batch.run import BatchResult

    path = write_requests(tmp_path / "r.jsonl", [request(i) for i in (0, 1, 3)])
    read = read_requests(path, "raise")
    failure = {"unit": "unit-00000", "type": "UnitTimeout", "message": "past 1 s",
               "traceback": "", "worker": "tcp://w", "attempt": 1, "ids": ["r0", "r1"]}  # fmt: skip
    result = BatchResult({}, None, [], [failure])
    out = tmp_path / "out"
    out.mkdir()
    assert write_results(out, read, result, "tiny")[:2] == (0, 3)
    lines = lines_of(out / "errors.jsonl")
    assert {e["response"]["status_code"] for e in lines} == {500}
    errors = {e["custom_id"]: e["response"]["body"]["error"]["message"] for e in lines}
    assert (
        errors["r0"]
        == errors["r1"]
        == "UnitTimeout: past 1 s (run the same command again to retry)"
    )
    assert errors["r3"] == "not answered (run the same command again)"
