"""What OpenAI Batch users send, answered (dask_pcm.apps.openai_batch on the tiny random Llama):
model names, list prompts and n draws, log-probabilities, JSON output, /v1/responses,
embeddings as base64 or shortened, shared prefixes. Bodies are parsed with the ``openai``
package's own models."""

from __future__ import annotations

import base64
import json
import math
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch
from openai.types import Completion, CreateEmbeddingResponse, ErrorObject
from openai.types.chat import ChatCompletion
from openai.types.responses import Response

import dask_pcm
from dask_pcm.apps.openai_batch import prefix_order, run_requests
from tests.apps import PERSON_SCHEMA

CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES = (
    "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"
)  # fmt: skip
SCHEMA = PERSON_SCHEMA


def req(custom_id: str, url: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def chat(text: str, system: str | None = None) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": text}
    ]


def answered(tmp_path: Path, client, model_dir, requests, name="out", **kwargs):
    """Run ``requests``; the output's and the errors' lines by custom_id, and the outcome."""
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in requests))
    out = tmp_path / name
    outcome = run_requests(path, out, model=model_dir, cluster=client, progress=False, **kwargs)
    lines = {}
    for file in ("output.jsonl", "errors.jsonl"):
        for line in (out / file).read_text().splitlines():
            record = json.loads(line)
            lines[record["custom_id"]] = record
    return lines, outcome


def body_of(line: dict) -> dict:
    assert line["error"] is None and line["response"]["status_code"] == 200, line
    return line["response"]["body"]


@pytest.fixture(scope="module")
def lm(tiny_model_dir):
    return dask_pcm.CausalLM(device="cpu")(str(tiny_model_dir))


def test_the_served_model_is_named_and_another_model_is_a_404(
    inproc_cluster, tiny_model_dir, tmp_path
):
    _, client = inproc_cluster
    requests = [
        req("mine", CHAT, model="local", messages=chat("Hi"), max_tokens=2),
        req("other", CHAT, model="gpt-4o-mini", messages=chat("Hi"), max_tokens=2),
        req("unnamed", COMPLETIONS, prompt="Hi", max_tokens=2),
    ]
    lines, outcome = answered(tmp_path, client, tiny_model_dir, requests, served_model_name="local")
    assert ChatCompletion.model_validate(body_of(lines["mine"])).model == "local"
    assert Completion.model_validate(body_of(lines["unnamed"])).model == "local"
    response = lines["other"]["response"]
    assert response["status_code"] == 404 and lines["other"]["error"] is None
    error = ErrorObject.model_validate(response["body"]["error"])
    assert (error.code, error.param, error.type) == (
        "model_not_found", "model", "invalid_request_error"
    )  # fmt: skip
    assert "gpt-4o-mini" in error.message and "'local'" in error.message
    assert (outcome.succeeded, outcome.failed) == (2, 1)
    # --any-model: every request answered by the served model; by default the folder's name.
    lines, _ = answered(tmp_path, client, tiny_model_dir, requests, name="any", any_model=True)
    assert {body_of(line)["model"] for line in lines.values()} == {"tiny-llama"}


def test_list_prompts_and_n_draws_are_one_choice_each_seeded_and_reproducible(
    inproc_cluster, tiny_model_dir, tmp_path, lm
):
    _, client = inproc_cluster
    prompts = ["Paris is", "Water boils at", "The Moon is"]
    sampled = dict(prompt=prompts, n=2, temperature=1.0, seed=5, max_tokens=6)
    requests = [
        req("sampled", COMPLETIONS, **sampled),
        req("greedy", COMPLETIONS, prompt=prompts[0], n=3, temperature=0, max_tokens=6),
        req("chat", CHAT, messages=chat("Hello"), n=2, temperature=1.0, seed=1, max_tokens=5),
    ]
    lines, _ = answered(tmp_path, client, tiny_model_dir, requests, any_model=True)
    done = Completion.model_validate(body_of(lines["sampled"]))
    assert [c.index for c in done.choices] == list(range(6))
    texts = [c.text for c in done.choices]
    # index = prompt * n + draw: the draws of one prompt differ, and each prompt counts once.
    assert all(texts[2 * p] != texts[2 * p + 1] for p in range(3))
    tokens = [len(lm.tokenizer(p)["input_ids"]) for p in prompts]
    assert done.usage.prompt_tokens == sum(tokens)
    assert done.usage.completion_tokens == 6 * 6  # the random model runs to the limit
    greedy = Completion.model_validate(body_of(lines["greedy"]))
    assert len({c.text for c in greedy.choices}) == 1 and len(greedy.choices) == 3
    assert len(ChatCompletion.model_validate(body_of(lines["chat"])).choices) == 2
    # The same seed, another run, other units: the same draws.
    again, _ = answered(tmp_path, client, tiny_model_dir, requests[:1], name="again")
    assert [c["text"] for c in body_of(again["sampled"])["choices"]] == texts


def test_embeddings_as_base64_and_shortened_to_dimensions(inproc_cluster, tiny_model_dir, tmp_path):
    _, client = inproc_cluster
    texts = ["Paris is the capital of France.", "Water"]
    requests = [
        req("float", EMBEDDINGS, input=texts),
        req("base64", EMBEDDINGS, input=texts, encoding_format="base64"),
        req("short", EMBEDDINGS, input=texts, dimensions=16),
        req("long", EMBEDDINGS, input=texts, dimensions=1000),
    ]
    lines, _ = answered(tmp_path, client, tiny_model_dir, requests)
    floats = CreateEmbeddingResponse.model_validate(body_of(lines["float"]))
    full = np.array([d.embedding for d in floats.data])
    encoded = body_of(lines["base64"])["data"]
    decoded = np.array([np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in encoded])
    np.testing.assert_allclose(decoded, full, rtol=1e-6, atol=1e-7)
    short = np.array([d.embedding for d in CreateEmbeddingResponse.model_validate(
        body_of(lines["short"])).data])  # fmt: skip
    head = full[:, :16] / np.linalg.norm(full[:, :16], axis=1, keepdims=True)
    np.testing.assert_allclose(short, head, rtol=1e-5, atol=1e-6)
    error = lines["long"]["response"]
    assert error["status_code"] == 400
    assert error["body"]["error"]["param"] == "dimensions"
    assert "embeddings have 64" in error["body"]["error"]["message"]


def test_logprobs_on_chat_and_completions_are_the_models(
    inproc_cluster, tiny_model_dir, tmp_path, lm
):
    _, client = inproc_cluster
    requests = [
        req("chat", CHAT, messages=chat("Hi"), max_tokens=4, temperature=0, logprobs=True,
            top_logprobs=3),
        req("plain", COMPLETIONS, prompt="Paris is", max_tokens=4, temperature=0, logprobs=2),
        req("none", COMPLETIONS, prompt="Paris is", max_tokens=4, temperature=0),
    ]  # fmt: skip
    lines, _ = answered(tmp_path, client, tiny_model_dir, requests)
    (choice,) = ChatCompletion.model_validate(body_of(lines["chat"])).choices
    content = choice.logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 3 for t in content)
    for t in content:  # greedy: the chosen token is the most likely one
        assert t.top_logprobs[0].token == t.token
        assert math.isclose(t.top_logprobs[0].logprob, t.logprob, abs_tol=1e-6)
        assert [x.logprob for x in t.top_logprobs] == sorted(
            (x.logprob for x in t.top_logprobs), reverse=True
        )
    assert "".join(t.token for t in content) == choice.message.content
    (legacy,) = Completion.model_validate(body_of(lines["plain"])).choices
    assert len(legacy.logprobs.tokens) == 4 and all(
        len(t) <= 2 for t in legacy.logprobs.top_logprobs
    )
    assert legacy.logprobs.text_offset[0] == len("Paris is")
    # The values are the model's: a plain forward pass over the prompt and the answer.
    ids = lm.tokenizer("Paris is")["input_ids"]
    answer = lm.tokenizer(legacy.text, add_special_tokens=False)["input_ids"]
    with torch.inference_mode():
        logits = lm.model(torch.tensor([ids + answer])).logits[0].float()
    expected = torch.log_softmax(logits, -1)[len(ids) - 1 : -1].gather(
        1, torch.tensor(answer)[:, None]
    )[:, 0]
    if len(answer) == 4:  # the text re-tokenizes to the same tokens
        np.testing.assert_allclose(legacy.logprobs.token_logprobs, expected.numpy(), atol=1e-4)
    assert Completion.model_validate(body_of(lines["none"])).choices[0].logprobs is None


def test_json_answers_parse_and_follow_their_schemas(inproc_cluster, tiny_model_dir, tmp_path):
    _, client = inproc_cluster
    strict = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA,
                                                      "strict": True}}  # fmt: skip
    requests = [
        req(f"s{i}", CHAT, messages=chat(f"Person {i}"), response_format=strict, max_tokens=120,
            temperature=0 if i % 2 else 1.0, seed=i)
        for i in range(6)
    ] + [
        req("object", CHAT, messages=chat("Any"), max_tokens=120, temperature=0,
            response_format={"type": "json_object"}),
        req("responses", RESPONSES, input="Who?", max_output_tokens=120, temperature=0,
            text={"format": {"type": "json_schema", "name": "p", "schema": SCHEMA,
                             "strict": True}}),
    ]  # fmt: skip
    lines, _ = answered(tmp_path, client, tiny_model_dir, requests)
    for i in range(6):
        (choice,) = ChatCompletion.model_validate(body_of(lines[f"s{i}"])).choices
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    (choice,) = ChatCompletion.model_validate(body_of(lines["object"])).choices
    assert isinstance(json.loads(choice.message.content), dict)
    response = Response.model_validate(body_of(lines["responses"]))
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), SCHEMA)


def test_responses_text_in_and_out(inproc_cluster, tiny_model_dir, tmp_path):
    _, client = inproc_cluster
    requests = [
        req("string", RESPONSES, model="tiny-llama", input="Hello there", instructions="Be brief.",
            max_output_tokens=3, temperature=0),
        req("messages", RESPONSES, input=[
            {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
            {"type": "message", "role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Again"}], max_output_tokens=2, temperature=0),
        req("as_chat", CHAT, messages=[{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hello there"}], max_tokens=3, temperature=0),
    ]  # fmt: skip
    lines, _ = answered(tmp_path, client, tiny_model_dir, requests)
    response = Response.model_validate(body_of(lines["string"]))
    assert response.object == "response" and response.model == "tiny-llama"
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.instructions == "Be brief."
    assert response.usage.output_tokens == 3
    assert response.usage.total_tokens == response.usage.input_tokens + 3
    # instructions are the system message: the same text as the chat with one.
    (choice,) = ChatCompletion.model_validate(body_of(lines["as_chat"])).choices
    assert response.output_text == choice.message.content
    assert Response.model_validate(body_of(lines["messages"])).usage.output_tokens == 2


def test_prefix_order_puts_requests_that_begin_alike_together():
    system = "You check facts. " * 20
    rows = []
    for i in range(30):
        messages = chat(f"claim {i}", system if i % 10 else f"Odd one {i}")
        rows.append({"endpoint": "chat", "params": "{}", "messages": messages})
    ordered = prefix_order(rows)
    shared = [r["messages"][0]["content"] == system for r in ordered]
    # The 27 that share the system prompt are consecutive: whole units share it.
    first = shared.index(True)
    assert shared[first : first + 27] == [True] * 27


def test_shared_prefixes_are_reused_and_the_greedy_text_is_the_same(
    make_cluster, tiny_model_dir, tmp_path
):
    client = make_cluster(n_workers=2)
    system = "You are a careful assistant who checks each claim against what you know. " * 6
    requests = [
        req(f"r{i}", CHAT, messages=chat(f"Claim {i}", system if i % 10 else f"Other {i}"),
            max_tokens=4, temperature=0)
        for i in range(40)
    ]  # fmt: skip
    kept, outcome = answered(tmp_path, client, tiny_model_dir, requests, requests_per_unit=8)
    usage = {i: body_of(line)["usage"] for i, line in kept.items()}
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usage.values()]
    assert sum(c > 0 for c in cached) >= 30
    status = json.loads((outcome.batch).read_text())
    assert status["usage"]["input_tokens_details"]["cached_tokens"] == sum(cached)
    # Workers that keep no prefix: every prompt runs whole.
    without = make_cluster(n_workers=2, config={"pcm.worker.prefix-cache": 0})
    plain, _ = answered(tmp_path, without, tiny_model_dir, requests, name="plain",
                        requests_per_unit=8)  # fmt: skip
    assert all(body_of(line)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
               for line in plain.values())  # fmt: skip
    texts = {i: body_of(line)["choices"][0]["message"]["content"] for i, line in kept.items()}
    assert texts == {
        i: body_of(line)["choices"][0]["message"]["content"] for i, line in plain.items()
    }
