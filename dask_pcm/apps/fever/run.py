"""``run_fever``: which prompt template makes a language model the best fact checker?

A FEVER run is a :func:`dask_pcm.run_batch` over the claims, one group per prompt template
(units ``<template>--<index>`` of ``claims_per_task`` claims), scored by the resident model
(:func:`~dask_pcm.apps.fever.units.score_rows`); before any unit, one task checks that every
prompt fits the model (:func:`~dask_pcm.apps.fever.fitting.refuse_unfit`). The batch layer gives
it waves of packed tasks, the resumable output folder and the fault handling; what is FEVER's
is here: the claims, the templates, the scoring and the ranking of the templates.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from dask_pcm import config
from dask_pcm.apps.fever.data import LABELS, demo_claims, load_claims, sample_claims
from dask_pcm.apps.fever.fitting import RowErrors, refuse_unfit
from dask_pcm.apps.fever.prompts import get_templates
from dask_pcm.apps.fever.result import FeverResult, in_order, summarize_groups
from dask_pcm.apps.fever.scoring import check_method
from dask_pcm.apps.fever.units import CONTEXT, score_rows
from dask_pcm.batch.run import run_batch
from dask_pcm.batch.segments import read_groups
from dask_pcm.context import content_digest, language_model

if TYPE_CHECKING:
    import pandas as pd


#: Claims per task (unit) when the caller gives none: with the template's head kept, a
#: unit's claims run packed in one pass, and this many make it long enough to use the
#: matrix products well (``benchmarks/prefix.py``).
CLAIMS_PER_TASK = 32


def run_fever(
    data: str | os.PathLike[str] | None = None,
    model: str | os.PathLike[str] | None = None,
    templates: Any = None,
    cluster: Any = None,
    level: str | None = None,
    claims_per_task: int = CLAIMS_PER_TASK,
    limit: int | None = None,
    method: str = "logits",
    output: str | os.PathLike[str] | None = None,
    errors: str = "raise",
    num_templates: int | None = None,
    workers: int | None = None,
    seed: int = 0,
    progress: bool = True,
    prefix_cache: bool = True,
    batch_size: int | None = None,
    truncate: bool | None = None,
    engine: str = "hf",
) -> FeverResult:
    """Score FEVER claims under several prompt templates and rank the templates.

    Parameters
    ----------
    data : path, optional
        FEVER JSON lines (``id``, ``label``, ``claim``). Default: a small demo set.
    model : str or path, optional
        Hugging Face directory, ``.gguf`` file or hub id; default the embedded
        SmolLM2-135M-Instruct.
    templates : optional
        Built-in names (list or ``"a,b"``), template strings with ``{claim}``, a template
        file, or ``PromptTemplate`` objects; default all built-ins.
    cluster : optional
        As for :func:`dask_pcm.run_batch`: ``None``/``"local"``, ``"sge"``, ``"htcondor"``
        (closed at the end), a scheduler address, a ``distributed.Client`` or a cluster
        (left open, the model resident for the next run; ``dask_pcm.unregister(client,
        "fever-llm")`` frees it).
    level : {"full", "partial", "agnostic"}, optional
        Default ``pcm.default-level``.
    claims_per_task : int
        Claims each task (unit) scores. The model's own forward passes take
        ``LanguageModel.batch_size`` prompts at a time; with the template's head kept
        (``prefix_cache``) one pass takes a unit's claims packed. Default
        ``CLAIMS_PER_TASK`` (this module's).
    limit : int, optional
        Score a stratified sample of this many claims (seeded by ``seed``).
    method : {"logits", "generate"}
    output : path, optional
        The resumable output folder of :func:`dask_pcm.run_batch`; it refuses predictions
        made with other model contents, loader options, method, claims per task, claims or
        templates of the same name (the error names what differs).
    errors : {"raise", "skip"}
        What to do with malformed lines of ``data`` and with claims whose prompt cannot fit
        the model (more tokens than its context, or more memory for one pass than the
        worker allows): ``"raise"`` stops before any unit is scored, naming the file and
        line; ``"skip"`` goes on, counts them (``report["skipped_lines"]``,
        ``report["row_errors"]``) and records each such prompt as a row with ``error`` set
        and no prediction. A row whose worker dies scoring it (twice) is recorded the same
        way whatever ``errors`` says, and the run goes on.
    truncate : bool, optional
        Cut over-long claims (from their end) until their prompts fit, instead of treating
        them as errors; each row says how many tokens were cut (``truncated_tokens``), and
        ``report["truncated"]`` counts them. Default ``pcm.fever.truncate`` (false). A
        template whose own text does not fit is refused either way.
    num_templates : int, optional
        Keep the first N templates.
    workers : int, optional
        Worker processes of the local cluster, or the most worker jobs of a batch cluster
        (``cluster`` given as a string only); at least 1.
    progress : bool
        A progress bar of units (tqdm), and, when ``run_fever`` starts the cluster itself,
        the addresses of Dask's dashboard and of the contexts page on standard error.
    prefix_cache : bool
        Keep each template's text before the claim as key/value states on every worker
        (``pcm.worker.prefix-cache``) and run only the claims' tokens (either method): the
        same predictions, faster the longer the templates' shared text. ``False`` runs whole
        prompts, for comparison. Not part of the output folder's provenance: either way the
        predictions are the same.
    batch_size : int, optional
        Old name of ``claims_per_task`` (deprecated).
    engine : {"hf", "vllm"}
        The model's engine on the workers: dask_pcm's Hugging Face forward loop
        (:func:`dask_pcm.causal_lm`, its prefix path), or vLLM (:func:`dask_pcm.vllm_lm`: a
        Hugging Face folder as ``model``; its prefix cache finds what prompts share).

    Returns
    -------
    FeverResult

    Examples
    --------
    >>> result = dask_pcm.run_fever(limit=30, num_templates=3)   # doctest: +SKIP
    >>> result.summary[["template", "accuracy", "n"]]            # doctest: +SKIP
    """
    if batch_size is not None:
        warnings.warn(
            "run_fever(batch_size=...) is now claims_per_task=...", FutureWarning, stacklevel=2
        )
        claims_per_task = batch_size
    check_method(method)
    if errors not in ("raise", "skip"):
        raise ValueError(f"errors must be 'raise' or 'skip', not {errors!r}")
    if claims_per_task < 1:
        raise ValueError(f"claims_per_task must be at least 1, got {claims_per_task}")
    if truncate is None:
        truncate = bool(config.get("fever.truncate"))
    claims = demo_claims() if data is None else load_claims(data, errors=errors)  # type: ignore[arg-type]
    if limit is not None:
        claims = sample_claims(claims, limit, seed=seed)
    chosen = get_templates(templates, num_templates)
    context = language_model(model, name=CONTEXT, engine=engine)
    names = [t.name for t in chosen]

    def check(client: Any, todo: Any) -> None:
        refuse_unfit(client, chosen, claims, method, errors, truncate, str(context.template))

    result = run_batch(
        score_rows,
        [{"claim_id": c.id, "claim": c.claim, "label": c.label} for c in claims],
        contexts=context,
        cluster=cluster,
        id_column="claim_id",
        rows_per_unit=claims_per_task,
        groups={t.name: {"template": t} for t in chosen},
        group_column="template",
        carry=("label",),
        output=output,
        # Prefix reuse changes the work, not the predictions: it is not recorded.
        provenance={
            "kwargs": {"method": method, "truncate": truncate},  # the digest is in contexts
            "info": {"group": "template"},
            "groups": {
                t.name: {"text": t.text, "chat": t.chat, "answers": list(t.answers)} for t in chosen
            },
        },
        level=level,
        workers=workers,
        progress=progress,
        prepare=check,
        method=method,
        prefix_cache=prefix_cache,
        truncate=truncate,
        model_digest=content_digest(context),
    )
    columns = ["template", "claim_id", "label", "predicted", "error", "truncated_tokens"]
    if method == "logits":
        columns += [f"score_{label}" for label in LABELS]
    seen = RowErrors(claims)

    def by_template() -> Iterator[tuple[str, pd.DataFrame]]:
        folder = result.output
        if folder is None:
            rows = result.to_pandas(columns)
            parts: Iterable[tuple[str, pd.DataFrame]] = rows[rows["template"].isin(names)].groupby(
                "template", sort=False
            )
        else:
            # The run kept no rows: one template's, read from the folder, at a time (a
            # million rows read at once would take the client's memory several times over).
            parts = read_groups(folder, "template", names, columns)
        for name, part in parts:
            seen.add(part)
            yield name, part

    summary = summarize_groups(by_template())
    report = {
        **result.report,
        "claims": len(claims),
        "skipped_lines": claims.skipped,
        "row_errors": seen.count,
        "row_error_examples": seen.examples,
        "truncated": seen.truncated,
    }
    seen.warn()
    predictions = None if output is not None else in_order(result.to_pandas(), names)
    return FeverResult(summary, predictions, report, output=output, templates=names)
