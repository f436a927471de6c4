"""End to end with the real embedded SmolLM2-135M-Instruct on a 2-process local cluster."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

import dask_pcm
from dask_pcm.cli import main


def _next_tokens(prompts: list[str]) -> list[str]:
    lm = dask_pcm.get_context("smollm2")
    ids = lm.next_token_logits(prompts).argmax(-1).tolist()
    return [lm.tokenizer.decode([i]) for i in ids]


def _complete(question: str) -> str:
    lm = dask_pcm.get_context("smollm2")
    return lm.complete(lm.chat_prompt(question), max_new_tokens=12)


@pytest.mark.slow
def test_embedded_smollm2_on_two_workers(make_cluster):
    prompts = [
        "The capital of France is",
        "Monday, Tuesday, Wednesday,",
        "One, two, three, four,",
        "The opposite of hot is",
    ]
    client = make_cluster(n_workers=2, processes=True)
    dask_pcm.register(client, dask_pcm.causal_lm(name="smollm2"))
    batch = dask_pcm.submit(client, _next_tokens, prompts, context="smollm2").result()
    answer = dask_pcm.submit(
        client, _complete, "What is the capital of France?", context="smollm2"
    ).result()
    table = dask_pcm.status(client)
    assert [batch[0].strip(), batch[2].strip()] == ["Paris", "five"]
    assert all(t.strip().isalpha() for t in batch)  # real words, not byte fragments
    assert "Paris" in answer
    assert list(table["loads"]) == [1, 1]
    assert list(table["state"]) == ["ready", "ready"]


def test_cli_reports_a_bad_model_path_without_a_traceback(tmp_path):
    missing = tmp_path / "no-such-model"
    result = CliRunner().invoke(main, ["demo", "--model", str(missing), "--workers", "1"])
    assert result.exit_code != 0
    assert str(missing) in result.output
    assert "Traceback" not in result.output
