"""What :func:`~dask_pcm.apps.fever.run.run_fever` returns: :class:`FeverResult`, and the summary
and prediction tables it is made of."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dask_pcm.batch.segments import read_predictions

if TYPE_CHECKING:
    import pandas as pd
    import pyarrow as pa


class FeverResult:
    """What :func:`run_fever` returns.

    Attributes
    ----------
    summary
        One row per template, best first: ``template, accuracy, n, macro_f1``, the recall of
        each label (``recall_SUPPORTS``...), ``unparseable``, then ``accuracy_ci_low`` and
        ``accuracy_ci_high`` (Wilson 95 %), ``calibrated_accuracy`` and
        ``calibrated_macro_f1`` (label bias removed), ``p_vs_best`` (exact McNemar against
        the first row); see :mod:`dask_pcm.apps.fever.ranking`.
    predictions
        One row per claim and template: ``claim_id, template, label, predicted``, the
        scores (``score_<LABEL>`` for method logits, ``generated`` for generate) and
        ``model_digest`` (the model's content digest,
        :func:`dask_pcm.batch.content_digest`), by template in the run's order. With
        ``output``, read from that folder when first used (a run of millions of rows
        keeps none of them in memory until asked).
    report
        ``wall_seconds``, ``units`` (total, computed now, reused from ``output``), ``tasks``
        (submitted), ``files`` (segments in ``output``), ``claims``, ``skipped_lines`` and
        ``workers`` (per worker: context loads, load seconds and the context tasks it ran in
        this run; empty when nothing was left to compute).
    output
        The output folder, or ``None``.
    """

    def __init__(
        self,
        summary: pd.DataFrame,
        predictions: pd.DataFrame | None,
        report: dict[str, Any] | None = None,
        output: str | os.PathLike[str] | None = None,
        templates: list[str] | None = None,
    ) -> None:
        if predictions is None and output is None:
            raise ValueError("FeverResult needs predictions or an output folder")
        self.summary = summary
        self.report = report or {}
        self.output = Path(output) if output is not None else None
        self._predictions = predictions
        self._templates = templates

    @property
    def predictions(self) -> pd.DataFrame:
        if self._predictions is None:
            assert self.output is not None
            where = None if self._templates is None else ("template", self._templates)
            self._predictions = in_order(
                read_predictions(self.output, where=where), self._templates
            )
        return self._predictions

    def __repr__(self) -> str:
        best = self.summary.iloc[0] if len(self.summary) else None
        lead = (
            f"best {best['template']!r} ({best['accuracy']:.3f})" if best is not None else "empty"
        )
        return f"FeverResult({len(self.summary)} templates, {lead}, output={self.output})"


def summarize(predictions: pd.DataFrame) -> pd.DataFrame:
    """One row per template, best first: accuracy, n, macro-F1, recall per label, unparseable,
    the accuracy's 95 % interval, calibrated accuracy and macro-F1, the p-value against
    the best template (:func:`dask_pcm.apps.fever.ranking.rank`), and the rows recorded as
    errors."""
    return summarize_groups(predictions.groupby("template", sort=False))


def summarize_groups(groups: Iterable[tuple[Any, pd.DataFrame]]) -> pd.DataFrame:
    """:func:`summarize` of the rows given one template at a time, as ``(template, rows)``
    pairs (see :func:`dask_pcm.apps.fever.ranking.rank_groups`)."""
    from dask_pcm.apps.fever.ranking import rank_groups  # pandas, only when a summary is made

    errors: dict[Any, int] = {}

    def answered() -> Iterator[tuple[Any, pd.DataFrame]]:
        # Rows recorded as errors have no prediction: they count apart, not as wrong answers.
        for name, rows in groups:
            if "error" in rows:
                failed = rows["error"].notna()
                errors[name] = int(failed.sum())
                rows = rows[~failed]
            if len(rows):
                yield name, rows

    table = rank_groups(answered())
    return table.assign(errors=table["template"].map(errors).fillna(0).astype(int))


def to_pandas(tables: list[pa.Table]) -> pd.DataFrame:
    import pandas as pd
    import pyarrow as pa

    if not tables:
        return pd.DataFrame(columns=["claim_id", "template", "label", "predicted"])
    return pa.concat_tables(tables, promote_options="default").to_pandas()


def in_order(predictions: pd.DataFrame, templates: list[str] | None) -> pd.DataFrame:
    """``predictions`` by template in the run's order (rows of one template as they came)."""
    if not templates or predictions.empty:
        return predictions.reset_index(drop=True)
    position = {name: i for i, name in enumerate(templates)}
    order = predictions["template"].map(position)
    return predictions.iloc[order.argsort(kind="stable")].reset_index(drop=True)
