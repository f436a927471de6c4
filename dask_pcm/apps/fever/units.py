"""The work of a FEVER run: the task that scores a unit of claims under one template.

:func:`score_rows` is the task function :func:`~dask_pcm.apps.fever.run.run_fever` gives
:func:`dask_pcm.run_batch`: it scores one unit's claims under one template with the resident
model context :data:`CONTEXT` (:func:`score_unit`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dask_pcm.apps.fever.data import Claim
from dask_pcm.apps.fever.fitting import CONTEXT, truncated
from dask_pcm.apps.fever.prompts import PromptTemplate
from dask_pcm.apps.fever.scoring import GENERATE_TOKENS, score_generate, score_logits
from dask_pcm.engine.model import prompt_problems
from dask_pcm.tasks import get_context

__all__ = ["CONTEXT", "score_rows", "score_unit", "template_head"]


def score_unit(
    template: PromptTemplate,
    claims: Sequence[Claim],
    method: str,
    context: str = CONTEXT,
    prefix_cache: bool = True,
    truncate: bool = False,
) -> list[dict[str, Any]]:
    """The task: score ``claims`` under ``template`` with the worker's resident model;
    with ``prefix_cache`` the template's part before the claim is computed once per worker
    (for either method).

    A prompt that cannot fit the model (:func:`~dask_pcm.engine.model.prompt_problems`: its
    context, or the memory one pass may take) is not run: its row carries ``error`` (and no
    prediction), or, with ``truncate``, its claim is cut until the prompt fits and the row
    says by how many tokens (``truncated_tokens``).
    """
    lm = get_context(context)
    new_tokens = 0 if method == "logits" else GENERATE_TOKENS
    texts = [c.claim for c in claims]
    prompts = [template.render(text, lm.tokenizer) for text in texts]
    problems = prompt_problems(lm, prompts, method, new_tokens)
    cut = [0] * len(prompts)
    for i, problem in enumerate(problems):
        if problem and truncate:
            texts[i], prompts[i], cut[i], problems[i] = truncated(lm, template, texts[i], method)
    fine = [i for i, p in enumerate(problems) if p is None]
    scored_fine: list[dict[str, Any]] = []
    if fine:
        chosen = [prompts[i] for i in fine]
        head = template_head(template, lm.tokenizer) if prefix_cache else None
        if method == "logits":
            scored_fine = score_logits(lm, chosen, template.answers, prefix=head)
        else:
            scored_fine = score_generate(lm, chosen, template.answers, new_tokens, prefix=head)
    scored: list[dict[str, Any]] = [{"predicted": None, "error": p} for p in problems]
    for i, row in zip(fine, scored_fine, strict=True):
        scored[i] = {**row, "error": None}
    if truncate:
        for row, tokens in zip(scored, cut, strict=True):
            row["truncated_tokens"] = tokens
    return [
        {"claim_id": c.id, "template": template.name, "label": c.label, **row}
        for c, row in zip(claims, scored, strict=True)
    ]


def score_rows(
    rows: Sequence[dict[str, Any]],
    template: PromptTemplate,
    method: str,
    context: str = CONTEXT,
    prefix_cache: bool = True,
    truncate: bool = False,
    model_digest: str | None = None,
) -> list[dict[str, Any]]:
    """The task function of a FEVER run: ``rows`` (``claim_id``, ``claim``, ``label``) scored
    under ``template`` by :func:`score_unit`; per row ``predicted``, the scores (or the
    generated text), ``error`` and, with ``truncate``, ``truncated_tokens``; and
    ``model_digest`` when given."""
    claims = [Claim(r["claim_id"], r["claim"], r["label"]) for r in rows]
    scored = score_unit(
        template, claims, method, context=context, prefix_cache=prefix_cache, truncate=truncate
    )
    keys = ("claim_id", "template", "label")  # the batch layer adds them
    extra = {} if model_digest is None else {"model_digest": model_digest}
    return [{**{k: v for k, v in row.items() if k not in keys}, **extra} for row in scored]


_MARK = "\x00claim\x00"


def template_head(template: PromptTemplate, tokenizer: Any) -> str:
    """The text of ``template``'s prompts before the claim, chat preamble included: what all
    its prompts share."""
    return template.render(_MARK, tokenizer).split(_MARK, 1)[0]
