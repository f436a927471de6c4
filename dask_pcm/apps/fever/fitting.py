"""Prompts that fit the model: how many tokens a prompt may have, and what a run does with
those that cannot fit.

A prompt fits when its tokens (and, for method ``generate``, the tokens to generate) are
within the model's context and one forward pass of it alone fits the memory budget of the
worker (:func:`dask_pcm.engine.model.prompt_problem`). On the workers,
:func:`check_prompts` finds, before any unit, the prompts of a run that cannot fit (only
claims long enough to matter are tokenized) and :func:`truncated` cuts a claim until its
prompt fits. On the client, :func:`refuse_unfit` turns what was found into an error before any
work, or a warning, and :class:`RowErrors` counts the rows recorded as errors as units finish.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from dask_pcm import client as pcm
from dask_pcm.apps.fever.data import ClaimSet
from dask_pcm.apps.fever.prompts import PromptTemplate
from dask_pcm.apps.fever.scoring import GENERATE_TOKENS
from dask_pcm.batch.watch import watched_result
from dask_pcm.engine.model import count_tokens, max_tokens, prompt_problem
from dask_pcm.exceptions import PromptTooLongError
from dask_pcm.tasks import get_context

if TYPE_CHECKING:
    import pandas as pd
    from distributed import Client

logger = logging.getLogger(__name__)

#: The name of the model context a FEVER run registers (:mod:`dask_pcm.apps.fever.units` exports it).
CONTEXT = "fever-llm"


def truncated(
    lm: Any, template: PromptTemplate, text: str, method: str
) -> tuple[str, str, int, str | None]:
    """``text`` cut (from its end) until ``template``'s prompt of it fits ``lm``: the text, the
    prompt, the tokens cut and what is still wrong (``None`` once it fits)."""
    new_tokens = 0 if method == "logits" else GENERATE_TOKENS
    with lm.lock:
        ids = lm.tokenizer(text, add_special_tokens=False)["input_ids"]
    keep = len(ids)
    prompt = template.render(text, lm.tokenizer)
    problem = prompt_problem(lm, count_tokens(lm, [prompt])[0], method, new_tokens)
    while problem and keep > 0:
        overflow = count_tokens(lm, [prompt])[0] + new_tokens - fitting_tokens(lm, method)
        keep = max(0, keep - max(overflow, 1))
        with lm.lock:
            text = lm.tokenizer.decode(ids[:keep])
        prompt = template.render(text, lm.tokenizer)
        problem = prompt_problem(lm, count_tokens(lm, [prompt])[0], method, new_tokens)
    return text, prompt, len(ids) - keep, problem


def fitting_tokens(lm: Any, method: str) -> int:
    """The most prompt tokens (new ones included) a pass on ``lm`` takes: the context, or
    fewer where one pass of more would not fit the memory budget."""
    new_tokens = 0 if method == "logits" else GENERATE_TOKENS
    low, high = 1, max_tokens(lm) or 1 << 20
    if prompt_problem(lm, high - new_tokens, method, new_tokens) is None:
        return high
    while low < high:  # the largest count with no problem
        middle = (low + high + 1) // 2
        if prompt_problem(lm, middle - new_tokens, method, new_tokens) is None:
            low = middle
        else:
            high = middle - 1
    return low


def check_prompts(
    templates: Sequence[PromptTemplate],
    claims: Sequence[str],
    method: str,
    context: str = CONTEXT,
) -> dict[str, Any]:
    """The task a run sends once before any unit: which prompts cannot fit the model.

    Returns ``limit`` (the most tokens a prompt may have, new ones included), ``templates``
    (each template's own tokens: its prompt for an empty claim) and ``too_long``: (index in
    ``claims``, template name, tokens, why) of every prompt that does not fit. Only claims
    whose UTF-8 length could make them too long are tokenized (a token holds at least one
    byte), so a run of short claims costs one small task.
    """
    lm = get_context(context)
    new_tokens = 0 if method == "logits" else GENERATE_TOKENS
    limit = fitting_tokens(lm, method)
    own = dict(
        zip(
            [t.name for t in templates],
            count_tokens(lm, [t.render("", lm.tokenizer) for t in templates]),
            strict=True,
        )
    )
    too_long = []
    slack = 8  # special tokens and the claim's merges with the text around it
    room = limit - new_tokens - max(own.values(), default=0) - slack
    suspects = [i for i, text in enumerate(claims) if len(text.encode("utf-8")) > room]
    for template in templates:
        if not suspects:
            break
        prompts = [template.render(claims[i], lm.tokenizer) for i in suspects]
        for i, tokens in zip(suspects, count_tokens(lm, prompts), strict=True):
            problem = prompt_problem(lm, tokens, method, new_tokens)
            if problem:
                too_long.append((i, template.name, tokens, problem))
    return {"limit": limit, "templates": own, "too_long": too_long}


def refuse_unfit(
    client: Client,
    templates: list[PromptTemplate],
    claims: ClaimSet,
    method: str,
    errors: str,
    truncate: bool,
    model: str,
) -> None:
    """Before any unit: refuse templates too long for the model and, with ``errors``
    "raise" (and no ``truncate``), claims whose prompts cannot fit; one small task
    (:func:`check_prompts`) on a worker with the model."""
    future = pcm.submit(
        client,
        check_prompts,
        templates,
        [c.claim for c in claims.claims],
        method,
        context=CONTEXT,
        pure=False,
    )
    found = watched_result(client, future)
    limit = found["limit"]
    for name, tokens in found["templates"].items():
        if tokens >= limit:
            raise PromptTooLongError(
                f"template {name!r} is {tokens} tokens without its claim; model {model} "
                f"takes prompts of at most {limit} tokens"
                f"{' with the answer' if method == 'generate' else ''} on these workers: "
                "shorten the template or use a model with a longer context"
            )
    too_long = found["too_long"]
    if not too_long or errors == "skip" or truncate:
        if too_long:
            logger.warning(
                "%d prompt(s) cannot fit the model; %s: %s",
                len(too_long),
                "their claims are cut to fit" if truncate else "recorded as errors",
                "; ".join(_too_long(claims, entry) for entry in too_long[:3]),
            )
        return
    shown = "\n  ".join(_too_long(claims, entry) for entry in too_long[:5])
    more = f"\n  (and {len(too_long) - 5} more)" if len(too_long) > 5 else ""
    raise PromptTooLongError(
        f"{len(too_long)} prompt(s) cannot fit the model, nothing was scored:\n  {shown}{more}\n"
        "errors='skip' (--errors skip) records them as errors and scores the rest; "
        "truncate=True (--truncate) cuts the claims to fit."
    )


def _too_long(claims: ClaimSet, entry: Any) -> str:
    index, template, _tokens, why = entry
    return f"{claims.where(index)}: under template {template!r}: {why}"


class RowErrors:
    """The rows of a run recorded as errors (and those truncated): how many, and the first
    few named by file and line.

    Parameters
    ----------
    claims
        The run's claims (where each comes from).
    rows
        The run's rows: ``claim_id``, ``template``, ``error`` and ``truncated_tokens``; or
        none, and :meth:`add` them a part (say, a template) at a time.
    """

    def __init__(self, claims: ClaimSet, rows: pd.DataFrame | None = None, keep: int = 5) -> None:
        self.claims, self.keep = claims, keep
        self.count = self.truncated = 0
        self.examples: list[str] = []
        self._index: dict[Any, int] | None = None
        if rows is not None:
            self.add(rows)

    def add(self, rows: pd.DataFrame) -> None:
        """Count ``rows`` in too."""
        failed = rows[rows["error"].notna()] if "error" in rows else rows.iloc[:0]
        self.count += len(failed)
        cut = rows.get("truncated_tokens")
        self.truncated += 0 if cut is None else int((cut.fillna(0) > 0).sum())
        wanted = self.keep - len(self.examples)
        if wanted <= 0 or failed.empty:
            return
        if self._index is None:
            self._index = {c.id: i for i, c in enumerate(self.claims.claims)}
        self.examples += [
            f"{self.claims.where(self._index.get(r.claim_id, -1))} under template "
            f"{r.template!r}: {r.error}"
            for r in failed.head(wanted).itertuples()
        ]

    def warn(self) -> None:
        """Log one warning when there are error rows."""
        if self.count:
            logger.warning(
                "%d row(s) recorded as errors, without a prediction: %s",
                self.count,
                "; ".join(self.examples),
            )
