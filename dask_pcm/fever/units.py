"""The work of a FEVER run: units, the task that scores one, and what its predictions depend on.

A *unit* is one (template, batch of claims): one task on a worker, using the resident model
context :data:`CONTEXT`. Its provenance (:func:`provenance`) is what determines its
predictions: the model's content (:func:`model_digest`), the loader's options, the method,
the claims per task, the claims and the template.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dask_pcm.fever.data import Claim, ClaimSet
from dask_pcm.fever.fitting import CONTEXT, truncated
from dask_pcm.fever.scoring import GENERATE_TOKENS, score_generate, score_logits
from dask_pcm.fever.templates import PromptTemplate
from dask_pcm.loaders.model import count_tokens, prompt_problem
from dask_pcm.tasks import get_context
from dask_pcm.templates.manifest import build_manifest
from dask_pcm.templates.sources import resolve_source

if TYPE_CHECKING:
    import pyarrow as pa


@dataclass(frozen=True)
class Unit:
    template: PromptTemplate
    index: int
    claims: tuple[Claim, ...]

    @property
    def name(self) -> str:
        return f"{self.template.name}--{self.index:05d}"


def score_unit(
    template: PromptTemplate,
    claims: Sequence[Claim],
    method: str,
    context: str = CONTEXT,
    prefix_cache: bool = True,
    truncate: bool = False,
) -> list[dict[str, Any]]:
    """The task: score ``claims`` under ``template`` with the worker's resident model;
    with ``prefix_cache`` the template's part before the claim is computed once per worker.

    A prompt that cannot fit the model (:func:`~dask_pcm.loaders.model.prompt_problem`: its
    context, or the memory one pass may take) is not run: its row carries ``error`` (and no
    prediction), or, with ``truncate``, its claim is cut until the prompt fits and the row
    says by how many tokens (``truncated_tokens``).
    """
    lm = get_context(context)
    new_tokens = 0 if method == "logits" else GENERATE_TOKENS
    texts = [c.claim for c in claims]
    prompts = [template.render(text, lm.tokenizer) for text in texts]
    problems: list[str | None] = [None] * len(prompts)
    cut = [0] * len(prompts)
    for i, tokens in enumerate(count_tokens(lm, prompts)):
        problem = prompt_problem(lm, tokens, method, new_tokens)
        if problem and truncate:
            texts[i], prompts[i], cut[i], problem = truncated(lm, template, texts[i], method)
        problems[i] = problem
    fine = [i for i, p in enumerate(problems) if p is None]
    scored_fine: list[dict[str, Any]] = []
    if fine:
        chosen = [prompts[i] for i in fine]
        if method == "logits":
            head = template_head(template, lm.tokenizer) if prefix_cache else None
            scored_fine = score_logits(lm, chosen, template.answers, prefix=head)
        else:
            scored_fine = score_generate(lm, chosen, template.answers, new_tokens)
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


def _typed(table: pa.Table) -> pa.Table:
    """``table`` with its text columns typed as text when all their values are missing (a
    unit of error rows), so that segments and units concatenate to one schema."""
    import pyarrow as pa

    for name in ("predicted", "error", "generated"):
        index = table.schema.get_field_index(name)
        if index >= 0 and pa.types.is_null(table.schema.field(index).type):
            table = table.set_column(index, name, table.column(name).cast(pa.string()))
    return table


def error_rows(unit: Unit, message: str) -> pa.Table:
    """The rows of ``unit`` recorded as errors (no prediction), each with ``message``."""
    import pyarrow as pa

    return _typed(
        pa.Table.from_pylist(
            [
                {
                    "claim_id": c.id,
                    "template": unit.template.name,
                    "label": c.label,
                    "predicted": None,
                    "error": message,
                }
                for c in unit.claims
            ]
        )
    )


def score_units(
    template: PromptTemplate,
    units: Sequence[tuple[str, Sequence[Claim]]],
    method: str,
    context: str = CONTEXT,
    prefix_cache: bool = True,
    truncate: bool = False,
) -> dict[str, Any]:
    """The task run_fever submits: several units (name, claims) of one template, scored one
    after the other by :func:`score_unit`.

    Returns ``units``, a list of (name, Arrow table of its rows): compact to send, cheap for
    Dask to size, and appended to the output as they are; and ``seconds``, the scoring time,
    from which the client sizes the next tasks.
    """
    import pyarrow as pa

    start = time.perf_counter()
    scored = []
    for name, claims in units:
        rows = score_unit(
            template, claims, method, context=context, prefix_cache=prefix_cache, truncate=truncate
        )
        scored.append((name, _typed(pa.Table.from_pylist(rows))))
    return {"units": scored, "seconds": time.perf_counter() - start}


_MARK = "\x00claim\x00"


def template_head(template: PromptTemplate, tokenizer: Any) -> str:
    """The text of ``template``'s prompts before the claim, chat preamble included: what all
    its prompts share."""
    return template.render(_MARK, tokenizer).split(_MARK, 1)[0]


def make_units(
    templates: Sequence[PromptTemplate], claims: ClaimSet, claims_per_task: int
) -> list[Unit]:
    """Every (template, batch of ``claims_per_task`` claims), templates first."""
    return [
        Unit(t, i, tuple(claims.claims[start : start + claims_per_task]))
        for t in templates
        for i, start in enumerate(range(0, len(claims), claims_per_task))
    ]


def provenance(
    context: Any,
    claims: ClaimSet,
    templates: list[PromptTemplate],
    method: str,
    claims_per_task: int,
) -> dict[str, Any]:
    """What determines this run's predictions, for the output folder (see ``store.py``)."""
    digest = hashlib.sha256()
    for c in claims.claims:
        digest.update(f"{c.id}\t{c.label}\t{c.claim}\n".encode())
    loader = context.loader
    options: Any = repr(loader)
    if dataclasses.is_dataclass(loader) and not isinstance(loader, type):
        options = dataclasses.asdict(loader)
    return {
        "model": context.template,
        "model_digest": model_digest(context.template),
        "loader": {"class": type(loader).__qualname__, "options": options},
        "method": method,
        "claims_per_task": claims_per_task,
        "claims": digest.hexdigest(),
        "templates": {
            t.name: {"text": t.text, "chat": t.chat, "answers": list(t.answers)} for t in templates
        },
    }


# Provenance hashes the model in chunks of this size whatever pcm.template.chunk-size is, so
# that a digest recorded in an output folder does not change with that setting.
_PROVENANCE_CHUNK = 64 * 2**20


def model_digest(model: str | os.PathLike[str] | None) -> str:
    """The content digest of a model: what it is, whatever path names it.

    For a local directory, ``.gguf`` file or the embedded model, the SHA-256 of its template
    files (:func:`dask_pcm.templates.manifest.build_manifest`, cached by path, size and modification
    time); for a hub id, ``hub:<id>@<revision>`` of the local snapshot.

    Raises
    ------
    ModelSourceError
        The model cannot be found (the message names the path).
    """
    resolved = resolve_source(model)
    if resolved.kind == "hub":
        return f"hub:{resolved.origin}@{resolved.path.name}"
    return build_manifest(model, _PROVENANCE_CHUNK)[0].digest
