"""Ranking prompt templates so that the order says no more than the claims support.

A FEVER run scores every template on the same few hundred claims. Accuracy alone orders
0.404, 0.367 and 0.333 as if those differences were real, yet on 240 claims each has a 95 %
interval of about six points either side, and a template that puts nearly every claim in one
label can look better or worse than one that reads the claims. :func:`rank` therefore gives,
besides accuracy, macro-F1 and the recall of each label:

- ``accuracy_ci_low``, ``accuracy_ci_high``: the Wilson 95 % interval of the accuracy
  (:func:`wilson_interval`);
- ``calibrated_accuracy``, ``calibrated_macro_f1``: the same metrics once each template's
  constant preference for one label is removed without gold labels
  (:func:`centred_predictions`);
- ``p_vs_best``: the exact McNemar test of each template against the best one, paired claim by
  claim (:func:`mcnemar_exact`), which is what decides whether two templates really differ.

numpy and pandas only: the binomial tail is summed exactly with integers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import pandas as pd

from dask_pcm.apps.fever.data import LABELS
from dask_pcm.apps.fever.scoring import UNPARSEABLE

#: The columns :func:`rank` adds after the per-template metrics, in this order.
RANK_COLUMNS = (
    "accuracy_ci_low",
    "accuracy_ci_high",
    "calibrated_accuracy",
    "calibrated_macro_f1",
    "p_vs_best",
)

#: How to read the table :func:`display_table` makes, for the lines under it.
HOW_TO_READ = """\
accuracy [95% CI]: accuracy on these claims with its Wilson 95 % interval.
p_vs_best: exact McNemar test against the best template, claim by claim; below 0.05 the gap is
  unlikely to be chance on these claims (not corrected for comparing several templates).
calibrated_*: the metrics once each template's constant bias towards a label is removed by
  centring its label scores over the claims (no gold labels used; '-' for method generate)."""


def wilson_interval(correct: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """The Wilson score interval of a proportion ``correct / n`` (95 % for the default ``z``).

    Wilson rather than the normal approximation (``p ± z·sqrt(p(1-p)/n)``): that one has zero
    width at 0 of n or n of n, can leave ``[0, 1]``, and covers far less than it claims at
    small ``n`` or near 0 or 1; Wilson's interval stays inside ``[0, 1]`` and keeps close to
    its nominal coverage there. ``(nan, nan)`` when ``n`` is 0.

    Example
    -------
    >>> [round(v, 4) for v in wilson_interval(5, 10)]
    [0.2366, 0.7634]
    """
    if n <= 0:
        return math.nan, math.nan
    if not 0 <= correct <= n:
        raise ValueError(f"correct must be between 0 and n={n}, got {correct}")
    p = correct / n
    z2 = z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def mcnemar_exact(b: int, c: int) -> float:
    """The two-sided exact McNemar p-value of two classifiers on the same items.

    ``b`` counts the items the first gets right and the second wrong, ``c`` the reverse (items
    both get right or both get wrong say nothing about which is better). Under the hypothesis
    that neither is better each discordant item goes either way with probability 1/2, so the
    p-value is ``min(1, 2 P(X <= min(b, c)))`` with ``X ~ Binomial(b + c, 1/2)``; 1.0 without
    discordant items. The tail is an exact integer sum, divided by ``2 ** (b + c)`` once.

    Example
    -------
    >>> mcnemar_exact(0, 6)
    0.03125
    """
    if b < 0 or c < 0:
        raise ValueError(f"discordant counts must be non-negative, got b={b}, c={c}")
    n = b + c
    if n == 0:
        return 1.0
    term, tail = 1, 0  # term is comb(n, k), updated exactly from comb(n, k - 1)
    for k in range(min(b, c) + 1):
        tail += term
        term = term * (n - k) // (k + 1)
    return min(1.0, 2 * tail / 2**n)


def label_metrics(gold: Any, predicted: Any, labels: Sequence[str] = LABELS) -> dict[str, float]:
    """``accuracy``, ``macro_f1`` and ``recall_<LABEL>`` of predictions against gold labels.

    The recall of a label no gold claim has is NaN; macro-F1 averages the F1 of the labels the
    gold claims have (an F1 is 0 when no claim of that label was predicted right). A prediction
    that is no label (``UNPARSEABLE``, ``None``) counts as wrong. Both the plain and the
    calibrated columns of :func:`rank` come from here.
    """
    gold = np.asarray(gold, dtype=object)
    predicted = np.asarray(predicted, dtype=object)
    out: dict[str, float] = {
        "accuracy": float(np.mean(gold == predicted)) if len(gold) else math.nan
    }
    f1s = []
    for label in labels:
        is_gold, is_pred = gold == label, predicted == label
        tp = int((is_gold & is_pred).sum())
        recall = tp / int(is_gold.sum()) if is_gold.any() else math.nan
        precision = tp / int(is_pred.sum()) if is_pred.any() else 0.0
        out[f"recall_{label}"] = recall
        if is_gold.any():
            f1s.append(0.0 if tp == 0 else 2 * precision * recall / (precision + recall))
    out["macro_f1"] = sum(f1s) / len(f1s) if f1s else math.nan
    return out


def macro_f1(gold: Any, predicted: Any, labels: Sequence[str] = LABELS) -> float:
    """The mean F1 over the labels the gold claims have (see :func:`label_metrics`)."""
    return label_metrics(gold, predicted, labels)["macro_f1"]


def centred_predictions(group: pd.DataFrame, labels: Sequence[str] = LABELS) -> pd.Series:
    """One template's predictions after removing its constant bias towards any label.

    ``group`` holds one template's rows with ``score_<LABEL>`` columns (log-probabilities,
    method logits). From each label's score its mean over the template's claims is
    subtracted, then each claim takes the label with the highest centred score. A template
    that adds the same amount to one label on every claim (a prompt that makes the model say
    "True" whatever the claim) thus gets that amount back, and what remains is what varies
    with the claim. It uses no gold labels, so it cannot leak them into the ranking, unlike
    calibration fitted on labelled claims; unlike calibration on a content-free input
    (``"N/A"`` in place of the claim) it needs no extra forward pass per template. It
    assumes the labels are not far from balanced among the claims (FEVER's dev set and the
    stratified samples of ``limit`` are): centred scores favour no label on average, so on a
    skewed set the frequent label is predicted less often than it occurs.

    Returns a Series on ``group``'s index: a label per claim, ``None`` where a score is
    missing or infinite, all ``None`` without score columns (method generate).
    """
    columns = [f"score_{label}" for label in labels]
    chosen = np.full(len(group), None, dtype=object)
    if set(columns) <= set(group.columns):
        scores = group[columns].to_numpy(dtype=float)
        usable = np.isfinite(scores).all(axis=1)
        if usable.any():
            centred = scores[usable] - scores[usable].mean(axis=0)
            chosen[usable] = np.asarray(labels, dtype=object)[centred.argmax(axis=1)]
    return pd.Series(chosen, index=group.index, dtype=object)


def rank(predictions: pd.DataFrame, labels: Sequence[str] = LABELS) -> pd.DataFrame:
    """One row per template, best first, with what it takes to judge the order.

    ``predictions`` has one row per (template, claim): ``template``, ``claim_id``, ``label``,
    ``predicted`` and, for method logits, ``score_<LABEL>``. Columns: ``template, accuracy,
    n, macro_f1``, ``recall_<LABEL>`` per label, ``unparseable``, then :data:`RANK_COLUMNS`.
    Sorted by accuracy, then macro-F1; the first row is the best, against which
    ``p_vs_best`` compares every other on the claims both scored (NaN for the best itself,
    and for a template sharing no claim with it).
    """
    return rank_groups(predictions.groupby("template", sort=False), labels)


def rank_groups(
    groups: Iterable[tuple[Any, pd.DataFrame]], labels: Sequence[str] = LABELS
) -> pd.DataFrame:
    """:func:`rank` of the rows given one template at a time, as ``(template, rows)`` pairs:
    only one template's rows need be in memory at once (a run of millions of rows reads
    them from its output folder template by template)."""
    rows, correct = [], {}
    for name, group in groups:
        rows.append(_template_row(name, group, labels))
        correct[name] = _correct_by_claim(name, group)
    columns = ["template", "accuracy", "n", "macro_f1"]
    columns += [f"recall_{label}" for label in labels] + ["unparseable", *RANK_COLUMNS]
    table = pd.DataFrame(rows, columns=columns)
    table = table.sort_values(["accuracy", "macro_f1"], ascending=False, ignore_index=True)
    table["p_vs_best"] = _p_vs_best(correct, list(table["template"]))
    return table


def _template_row(name: Any, group: pd.DataFrame, labels: Sequence[str]) -> dict[str, Any]:
    """The metrics of one template's rows (all but ``p_vs_best``)."""
    gold, predicted = group["label"], group["predicted"]
    row: dict[str, Any] = {"template": name, "n": len(group)}
    row.update(label_metrics(gold, predicted, labels))
    row["unparseable"] = int((predicted == UNPARSEABLE).sum())
    low, high = wilson_interval(int((predicted == gold).sum()), len(group))
    row["accuracy_ci_low"], row["accuracy_ci_high"] = low, high
    calibrated = centred_predictions(group, labels)
    metrics = {} if calibrated.isna().all() else label_metrics(gold, calibrated, labels)
    row["calibrated_accuracy"] = metrics.get("accuracy", math.nan)
    row["calibrated_macro_f1"] = metrics.get("macro_f1", math.nan)
    return row


def _correct_by_claim(name: Any, group: pd.DataFrame) -> pd.Series:
    """Whether each claim of one template's rows was answered right, by ``claim_id``."""
    repeated = group["claim_id"].duplicated()
    if repeated.any():
        claim = group["claim_id"][repeated].iloc[0]
        raise ValueError(
            f"template {name!r} has claim_id {claim!r} more than once: p_vs_best pairs "
            "templates claim by claim"
        )
    right = (group["predicted"] == group["label"]).to_numpy(dtype=bool)
    return pd.Series(right, index=group["claim_id"].to_numpy())


def _p_vs_best(correct: dict[Any, pd.Series], order: list[Any]) -> list[float]:
    """The exact McNemar p-value of each template in ``order`` against ``order[0]``, paired by
    ``claim_id`` (so the rows may come in any order)."""
    if not order:
        return []
    best = correct[order[0]]
    out = [math.nan]
    for name in order[1:]:
        first, other = best.align(correct[name], join="inner")
        if first.empty:
            out.append(math.nan)
            continue
        first, other = first.astype(bool), other.astype(bool)
        out.append(mcnemar_exact(int((first & ~other).sum()), int((~first & other).sum())))
    return out


def display_table(table: pd.DataFrame) -> pd.DataFrame:
    """:func:`rank`'s table as text for a terminal: accuracy with its interval as
    ``0.404 [0.342, 0.469]``, metrics to 3 decimals, ``p_vs_best`` to 3 significant digits
    (``best`` on the best row), ``-`` where a value is missing."""

    def number(value: Any, spec: str = ".3f") -> str:
        return "-" if pd.isna(value) else format(value, spec)

    shown = pd.DataFrame({"template": table["template"]})
    shown["accuracy [95% CI]"] = [
        f"{number(a)} [{number(lo)}, {number(hi)}]"
        for a, lo, hi in zip(
            table["accuracy"], table["accuracy_ci_low"], table["accuracy_ci_high"], strict=True
        )
    ]
    shown["n"] = table["n"]
    for column in table.columns:
        if column.startswith(("macro_f1", "recall_", "calibrated_")):
            shown[column] = table[column].map(number)
        elif column == "unparseable" or (column == "errors" and table[column].any()):
            shown[column] = table[column]
    shown["p_vs_best"] = [
        "best" if i == 0 else number(p, "#.3g") for i, p in enumerate(table["p_vs_best"])
    ]
    return shown
