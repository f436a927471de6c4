"""Ranking templates: Wilson intervals, exact McNemar p-values, label-free calibration."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from dask_pcm.apps.fever.data import LABELS
from dask_pcm.apps.fever.ranking import (
    RANK_COLUMNS,
    centred_predictions,
    display_table,
    label_metrics,
    macro_f1,
    mcnemar_exact,
    rank,
    wilson_interval,
)
from dask_pcm.apps.fever.result import summarize, summarize_groups
from dask_pcm.apps.fever.scoring import UNPARSEABLE

S, R, N = LABELS
SCORES = [f"score_{label}" for label in LABELS]


@pytest.mark.parametrize(
    ("correct", "n", "low", "high"),
    [
        (0, 10, 0.0, 0.2775),
        (5, 10, 0.2366, 0.7634),
        (10, 10, 0.7225, 1.0),
        # Newcombe (1998), Statistics in Medicine 17:857, table I, the score method:
        (81, 263, 0.2553, 0.3662),
        (15, 148, 0.0624, 0.1605),
        (0, 20, 0.0, 0.1611),
        (1, 29, 0.0061, 0.1718),
    ],
)
def test_wilson_interval_matches_published_values(correct, n, low, high):
    assert wilson_interval(correct, n) == pytest.approx((low, high), abs=5e-5)


def test_wilson_interval_is_inside_zero_one_and_nan_without_claims():
    for n in (1, 2, 7, 240):
        for correct in range(n + 1):
            low, high = wilson_interval(correct, n)
            assert 0.0 <= low <= correct / n <= high <= 1.0
    assert all(math.isnan(v) for v in wilson_interval(0, 0))
    with pytest.raises(ValueError, match="between 0 and n"):
        wilson_interval(11, 10)


@pytest.mark.parametrize(
    ("b", "c", "p"),
    [
        (0, 6, 0.03125),  # 2 / 2**6
        (6, 0, 0.03125),
        (3, 3, 1.0),  # 2 * 42/64 > 1
        (1, 9, 0.021484375),  # 2 * (1 + 10) / 2**10
        (4, 11, 0.11846923828125),  # 2 * (1 + 15 + 105 + 455 + 1365) / 2**15
        (0, 0, 1.0),
    ],
)
def test_mcnemar_exact_matches_hand_computed_p_values(b, c, p):
    assert mcnemar_exact(b, c) == pytest.approx(p, rel=1e-12)


def test_mcnemar_exact_handles_many_discordant_claims():
    assert mcnemar_exact(500, 500) == 1.0
    assert 0 < mcnemar_exact(400, 600) < 1e-9
    with pytest.raises(ValueError, match="non-negative"):
        mcnemar_exact(-1, 3)


def test_label_metrics_by_hand():
    gold, predicted = [S, S, R, N], [S, R, R, S]
    metrics = label_metrics(gold, predicted)
    # F1: SUPPORTS 1/2 (P 1/2, R 1/2), REFUTES 2/3 (P 1/2, R 1), NEI 0.
    assert metrics["accuracy"] == 0.5
    assert metrics["macro_f1"] == pytest.approx((0.5 + 2 / 3 + 0) / 3)
    assert (metrics[f"recall_{S}"], metrics[f"recall_{R}"], metrics[f"recall_{N}"]) == (
        0.5,
        1.0,
        0.0,
    )
    assert macro_f1(gold, predicted, LABELS) == metrics["macro_f1"]
    # Labels without gold claims: recall NaN, left out of the macro average.
    only = label_metrics([S, S], [S, R])
    assert math.isnan(only[f"recall_{R}"]) and math.isnan(only[f"recall_{N}"])
    assert only["macro_f1"] == pytest.approx(2 / 3)


def _logits_rows(template, labels, bias=0.0, wrong=(), seed=0):
    """Informative scores (the gold label ahead by 1, noise below 0.3), SUPPORTS + ``bias``;
    the claims in ``wrong`` get their scores rotated so that another label leads."""
    rng = np.random.default_rng(seed)
    rows = []
    for claim_id, gold in enumerate(labels):
        scores = np.full(3, -2.0) + rng.uniform(0, 0.3, 3)
        scores[LABELS.index(gold)] += 1.0
        if claim_id in wrong:
            scores = np.roll(scores, 1)
        scores[0] += bias
        row = {"claim_id": claim_id, "template": template, "label": gold}
        row["predicted"] = LABELS[int(scores.argmax())]
        row.update(zip(SCORES, scores.tolist(), strict=True))
        rows.append(row)
    return rows


BALANCED = [LABELS[i % 3] for i in range(30)]


def test_calibration_removes_a_constant_label_bias():
    biased = pd.DataFrame(_logits_rows("always-true", BALANCED, bias=5.0))
    assert (biased["predicted"] == S).all()  # the bias swamps what the claim says
    row = rank(biased).iloc[0]
    assert row["accuracy"] == pytest.approx(1 / 3)
    assert row["calibrated_accuracy"] == 1.0 and row["calibrated_macro_f1"] == 1.0
    assert list(centred_predictions(biased)) == BALANCED


def test_calibration_uses_no_gold_labels():
    group = pd.DataFrame(_logits_rows("t", BALANCED, bias=5.0, wrong=(1, 4, 7)))
    relabelled = group.assign(label=np.random.default_rng(1).permutation(group["label"]))
    assert centred_predictions(relabelled).equals(centred_predictions(group))


def test_missing_scores_give_no_calibrated_prediction():
    group = pd.DataFrame(_logits_rows("t", BALANCED))
    group.loc[3, SCORES[1]] = float("nan")
    calibrated = centred_predictions(group)
    assert calibrated[3] is None
    assert calibrated.drop(3).tolist() == [g for i, g in enumerate(BALANCED) if i != 3]


def test_p_vs_best_pairs_claims_by_id_whatever_the_row_order():
    best = _logits_rows("best", BALANCED)
    worse = _logits_rows("worse", BALANCED, wrong=range(6), seed=1)  # b = 6, c = 0
    partial = _logits_rows("partial", BALANCED[:10], wrong=range(3), seed=2)  # on 10 claims
    rng = np.random.default_rng(3)
    frame = pd.DataFrame(best + worse[::-1] + partial).sample(frac=1, random_state=4)
    frame = frame.reset_index(drop=True)
    table = rank(frame)
    assert list(table["template"]) == ["best", "worse", "partial"]  # 30/30, 24/30, 7/10
    assert math.isnan(table.loc[0, "p_vs_best"])
    assert table.loc[1, "p_vs_best"] == pytest.approx(0.03125)
    assert table.loc[2, "p_vs_best"] == pytest.approx(0.25)  # b = 3, c = 0 on shared claims
    shuffled = rank(frame.iloc[rng.permutation(len(frame))])
    pd.testing.assert_frame_equal(shuffled, table)


def test_p_vs_best_refuses_a_claim_scored_twice():
    rows = _logits_rows("a", BALANCED) + _logits_rows("b", BALANCED)
    frame = pd.DataFrame([*rows, rows[-1]])
    with pytest.raises(ValueError, match="more than once"):
        rank(frame)


def test_generate_predictions_have_no_calibrated_columns():
    predicted = [S, S, R, UNPARSEABLE, N, S]
    frame = pd.DataFrame(
        {
            "claim_id": range(6),
            "template": "generated",
            "label": [S, R, R, N, N, S],
            "predicted": predicted,
            "generated": [" True", " True", " False", " Hmm", " Unknown", " True"],
        }
    )
    row = rank(frame).iloc[0]
    assert row["accuracy"] == pytest.approx(4 / 6) and row["unparseable"] == 1
    assert (row["accuracy_ci_low"], row["accuracy_ci_high"]) == wilson_interval(4, 6)
    assert math.isnan(row["calibrated_accuracy"]) and math.isnan(row["calibrated_macro_f1"])
    assert centred_predictions(frame).isna().all()
    assert display_table(rank(frame)).loc[0, "calibrated_accuracy"] == "-"


def test_summarize_a_small_realistic_run():
    rows = _logits_rows("fact-checker", BALANCED, wrong=(0, 1, 5))
    rows += _logits_rows("direct", BALANCED, bias=0.8, wrong=(2, 9, 13), seed=5)
    rows += _logits_rows("yes-man", BALANCED, bias=6.0, seed=6)
    predictions = pd.DataFrame(rows).sample(frac=1, random_state=0)
    table = summarize(predictions)
    recalls = [f"recall_{label}" for label in LABELS]
    head = ["template", "accuracy", "n", "macro_f1", *recalls, "unparseable"]
    assert list(table.columns) == [*head, *RANK_COLUMNS, "errors"]
    pd.testing.assert_frame_equal(table, rank(predictions).assign(errors=0))
    assert list(table["template"]) == ["fact-checker", "direct", "yes-man"]
    assert list(table["n"]) == [30] * 3
    assert list(table["accuracy"]) == sorted(table["accuracy"], reverse=True)
    for row in table.itertuples():
        group = predictions[predictions["template"] == row.template]
        correct = int((group["predicted"] == group["label"]).sum())
        assert row.accuracy == correct / 30
        assert (row.accuracy_ci_low, row.accuracy_ci_high) == wilson_interval(correct, 30)
        assert row.macro_f1 == macro_f1(group["label"], group["predicted"], LABELS)
        assert row.unparseable == 0
    yes_man = table.set_index("template").loc["yes-man"]
    assert yes_man["accuracy"] == pytest.approx(1 / 3) and yes_man["calibrated_accuracy"] == 1.0
    # The best misses claims 0, 1 and 5; yes-man gets the 10 SUPPORTS claims (ids 0, 3, ...).
    assert yes_man["p_vs_best"] == mcnemar_exact(18, 1)
    shown = display_table(table)
    assert list(shown["p_vs_best"]) == ["best", "1.00", "7.63e-05"]
    assert shown.loc[0, "accuracy [95% CI]"] == "0.900 [0.744, 0.965]"
    assert list(shown.columns[:3]) == ["template", "accuracy [95% CI]", "n"]


def test_an_empty_run_ranks_to_an_empty_table():
    empty = pd.DataFrame(columns=["claim_id", "template", "label", "predicted"])
    table = rank(empty)
    assert table.empty and list(table.columns[-len(RANK_COLUMNS) :]) == list(RANK_COLUMNS)


def test_rows_recorded_as_errors_count_apart_not_as_wrong_answers():
    rows = _logits_rows("fact-checker", BALANCED, wrong=(0, 1, 5))
    predictions = pd.DataFrame(rows).assign(error=None)
    failed = predictions.copy()
    failed.loc[failed.index[:2], ["predicted", "error"]] = [None, "too long"]
    table = summarize(failed)
    assert table["errors"].tolist() == [2]
    assert table["n"].tolist() == [len(predictions) - 2]
    expected = summarize(predictions.iloc[2:])
    assert table["accuracy"].tolist() == expected["accuracy"].tolist()


def test_a_summary_made_one_template_at_a_time_is_the_same_as_from_all_rows():
    """How ``run_fever`` summarises a run with an output folder: it reads one template's rows
    at a time (a million rows at once took the client's memory several times over)."""
    rows = _logits_rows("fact-checker", BALANCED, wrong=(0, 1, 5))
    rows += _logits_rows("direct", BALANCED, bias=0.8, wrong=(2, 9, 13), seed=5)
    rows += _logits_rows("yes-man", BALANCED, bias=6.0, seed=6)
    predictions = pd.DataFrame(rows).assign(error=None).sample(frac=1, random_state=1)
    predictions.loc[predictions.index[:3], ["predicted", "error"]] = [None, "too long"]
    parts = [(name, predictions[predictions["template"] == name]) for name in ("yes-man", "direct")]
    parts.insert(1, ("fact-checker", predictions[predictions["template"] == "fact-checker"]))
    pd.testing.assert_frame_equal(summarize_groups(iter(parts)), summarize(predictions))
    yes_man = parts[0][1]
    twice = pd.concat([yes_man, yes_man[yes_man["error"].isna()].head(1)])
    with pytest.raises(ValueError, match=r"'yes-man' has claim_id .* more than once"):
        summarize_groups(iter([(parts[1][0], parts[1][1]), ("yes-man", twice)]))
