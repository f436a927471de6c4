"""Scoring a batch of prompts: label likelihoods in one pass, or a parsed generated verdict."""

from __future__ import annotations

import pytest

import dask_pcm
from dask_pcm.apps.fever.data import LABELS
from dask_pcm.apps.fever.scoring import (
    UNPARSEABLE,
    answer_token_ids,
    check_method,
    parse_verdict,
    score_generate,
    score_logits,
)

ANSWERS = ("True", "False", "Unknown")


@pytest.fixture(scope="module")
def lm(tiny_model_dir):
    return dask_pcm.CausalLM(device="cpu")(str(tiny_model_dir))


def test_answer_tokens_cover_both_spacings_and_must_differ(lm):
    ids = answer_token_ids(lm.tokenizer, ANSWERS)
    assert len(ids) == 3
    flat = [t for variants in ids for t in variants]
    assert len(flat) == len(set(flat))
    for word, variants in zip(ANSWERS, ids, strict=True):
        assert lm.tokenizer.encode(word, add_special_tokens=False)[0] in variants
        assert all(lm.tokenizer.decode([t]).strip() for t in variants)
    with pytest.raises(ValueError, match="share their first token"):
        answer_token_ids(lm.tokenizer, ("True", "True", "Unknown"))


def test_logits_scores_are_label_log_probabilities(lm):
    prompts = [f"Claim: the river is {w}. True, False or Unknown? Answer:" for w in "abcde"]
    rows = score_logits(lm, prompts, ANSWERS)
    assert len(rows) == 5
    for row in rows:
        scores = [row[f"score_{label}"] for label in LABELS]
        assert all(s <= 0 for s in scores)
        assert row["predicted"] == LABELS[scores.index(max(scores))]
    # A prompt scores the same alone as in a batch (left padding, one pass per batch).
    alone = score_logits(lm, prompts[:1], ANSWERS)[0]
    for label in LABELS:
        assert alone[f"score_{label}"] == pytest.approx(rows[0][f"score_{label}"], abs=1e-4)


def test_generate_gives_a_label_or_unparseable_never_a_guess(lm):
    rows = score_generate(lm, ["Claim: x. Answer:", "Claim: a longer claim here. Answer:"], ANSWERS)
    assert len(rows) == 2
    for row in rows:
        assert isinstance(row["generated"], str)
        assert row["predicted"] == parse_verdict(row["generated"], ANSWERS)
        assert row["predicted"] in (*LABELS, UNPARSEABLE)


def test_batched_generation_matches_single_completion(lm):
    prompts = ["The claim is", "A much longer prompt about rivers and mountains is"]
    assert lm.generate(prompts, max_new_tokens=4) == [lm.complete(p, 4) for p in prompts]
    assert lm.generate([], 4) == []
    with pytest.raises(TypeError, match="sequence of prompts"):
        lm.generate("one prompt", 4)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (" True.", "SUPPORTS"),
        ("false, because", "REFUTES"),
        (" UNKNOWN", "NOT ENOUGH INFO"),
        (" It is false, not true.", "REFUTES"),  # the first answer word counts
        (" Untrue", UNPARSEABLE),  # whole words only
        (" I cannot say", UNPARSEABLE),
        ("", UNPARSEABLE),
    ],
)
def test_parse_verdict(text, expected):
    assert parse_verdict(text, ANSWERS) == expected


def test_unknown_method_is_named():
    assert check_method("logits") == "logits"
    with pytest.raises(ValueError, match="unknown scoring method 'vote'"):
        check_method("vote")
