"""``run_fever``: which prompt template makes a language model the best fact checker?

The work is a grid of *units*, one per (template, batch of claims). Each unit is one task that
uses the resident model context (:func:`dask_pcm.get_context`) and returns one prediction row
per claim. With ``output=`` every finished unit is written at once as its own Parquet file in
the output folder (:mod:`dask_pcm.fever.store`: locked for the run, atomic parts, resume keyed
on what determines a prediction), so a run that is killed keeps what it finished, a rerun
computes only the missing units, and no row is written twice."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from distributed import Client, as_completed
from distributed.scheduler import KilledWorker

from dask_pcm import client as pcm
from dask_pcm import config
from dask_pcm.context import causal_lm
from dask_pcm.deploy.batch import KINDS, batch_cluster
from dask_pcm.deploy.local import local_cluster
from dask_pcm.fever.data import (
    demo_claims,
    load_claims,
    sample_claims,
)
from dask_pcm.fever.scoring import check_method
from dask_pcm.fever.store import OutputStore
from dask_pcm.fever.templates import get_templates
from dask_pcm.fever.units import CONTEXT, Unit, make_units, provenance, score_unit

if TYPE_CHECKING:
    import pandas as pd

logger = logging.getLogger(__name__)


@dataclass
class FeverResult:
    """What :func:`run_fever` returns.

    Attributes
    ----------
    summary
        One row per template, best first: ``template, accuracy, n, macro_f1``, the recall of
        each label (``recall_SUPPORTS``...), ``unparseable``, then ``accuracy_ci_low`` and
        ``accuracy_ci_high`` (Wilson 95 %), ``calibrated_accuracy`` and
        ``calibrated_macro_f1`` (label bias removed), ``p_vs_best`` (exact McNemar against
        the first row); see :mod:`dask_pcm.fever.ranking`.
    predictions
        One row per claim and template: ``claim_id, template, label, predicted``, the
        scores (``score_<LABEL>`` for method logits, ``generated`` for generate) and
        ``model_digest`` (the model's content digest,
        :func:`~dask_pcm.fever.units.model_digest`).
    report
        ``wall_seconds``, ``units`` (total, computed now, reused from ``output``), ``workers``
        (per worker: context loads, load seconds and the context tasks it ran in this run).
    """

    summary: pd.DataFrame
    predictions: pd.DataFrame
    report: dict[str, Any] = field(default_factory=dict)


#: Most worker jobs of a batch cluster that run_fever starts itself (``workers`` unset).
BATCH_WORKERS = 4


def run_fever(
    data: str | os.PathLike[str] | None = None,
    model: str | os.PathLike[str] | None = None,
    templates: Any = None,
    cluster: Any = None,
    level: str | None = None,
    claims_per_task: int = 16,
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
        ``None`` or ``"local"``: a local cluster sized to the machine, closed at the end.
        ``"sge"`` or ``"htcondor"``: worker jobs on that batch system
        (:func:`dask_pcm.batch_cluster`, scaled adaptively between 1 and ``workers``
        jobs, default 4; job settings from dask-jobqueue's configuration), closed at the
        end. A ``distributed.Client`` or a cluster object: used as it is, and the model
        context stays registered afterwards so that the next run reuses the resident model
        (``dask_pcm.unregister(client, "fever-llm")`` frees it).
    level : {"full", "partial", "agnostic"}, optional
        Default ``pcm.default-level``.
    claims_per_task : int
        Claims each task (unit) scores. The model's own forward passes take
        ``LanguageModel.batch_size`` prompts at a time.
    limit : int, optional
        Score a stratified sample of this many claims (seeded by ``seed``).
    method : {"logits", "generate"}
    output : path, optional
        Folder of Parquet files, one per finished unit; rerunning with the same folder
        resumes. It is locked while the run lasts, and must not hold predictions made with
        other model contents, loader options, method, claims per task, claims, or other
        templates of the same name (the error names what differs).
    errors : {"raise", "skip"}
        What to do with malformed lines of ``data``.
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
        (``pcm.worker.prefix-cache``) and run only the claims' tokens (method ``logits``):
        the same predictions, several times faster for long templates. ``False`` runs whole
        prompts, for comparison. Not part of the output folder's provenance: either way the
        predictions are the same.
    batch_size : int, optional
        Old name of ``claims_per_task`` (deprecated).

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
    level = config.check_level(level) if level is not None else config.default_level()
    if claims_per_task < 1:
        raise ValueError(f"claims_per_task must be at least 1, got {claims_per_task}")
    if errors not in ("raise", "skip"):
        raise ValueError(f"errors must be 'raise' or 'skip', not {errors!r}")
    if workers is not None and workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    claims = demo_claims() if data is None else load_claims(data, errors=errors)  # type: ignore[arg-type]
    if limit is not None:
        claims = sample_claims(claims, limit, seed=seed)
    chosen = get_templates(templates, num_templates)
    units = make_units(chosen, claims, claims_per_task)
    context = causal_lm(model, name=CONTEXT)
    recorded = provenance(context, claims, chosen, method, claims_per_task)

    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        store = stack.enter_context(OutputStore(output, recorded)) if output else None
        done = store.done({u.name: len(u.claims) for u in units}) if store else set()
        todo = [u for u in units if u.name not in done]
        client, owned = _client(cluster, workers)
        if owned and progress:
            # Where to watch: the cluster is ours, so the user has no other way to know.
            print(
                f"Dask dashboard: {client.dashboard_link}\n"
                f"Contexts:       {pcm.status_page(client)}",
                file=sys.stderr,
                flush=True,
            )
        try:
            pcm.register(client, context, level=level)
            before = _tasks_by_worker(client)
            digest = recorded["model_digest"]
            rows = _compute(client, todo, method, store, digest, progress, prefix_cache)
            after = pcm.status(client, [CONTEXT])
        finally:
            if owned:
                cluster_obj = client.cluster
                client.close()
                if cluster_obj is not None:
                    cluster_obj.close()
        if store:
            rows = store.read([u.name for u in units])
    import pandas as pd

    predictions = pd.DataFrame(rows)
    report = {
        "wall_seconds": time.perf_counter() - start,
        "units": {"total": len(units), "computed": len(todo), "reused": len(units) - len(todo)},
        "claims": len(claims),
        "skipped_lines": claims.skipped,
        "workers": [
            {
                "worker": r.worker,
                "context": r.context,
                "loads": int(r.loads),
                "load_seconds": float(r.load_seconds),
                "tasks": int(r.tasks) - before.get(r.worker, 0),
            }
            for r in after.itertuples()
        ],
    }
    return FeverResult(summarize(predictions), predictions, report)


def summarize(predictions: pd.DataFrame) -> pd.DataFrame:
    """One row per template, best first: accuracy, n, macro-F1, recall per label, unparseable,
    the accuracy's 95 % interval, calibrated accuracy and macro-F1, and the p-value against
    the best template (:func:`dask_pcm.fever.ranking.rank`)."""
    from dask_pcm.fever.ranking import rank  # pandas, only when a summary is made

    return rank(predictions)


def _client(cluster: Any, workers: int | None) -> tuple[Client, bool]:

    if cluster is None or cluster == "local":
        return Client(local_cluster(n_workers=workers)), True
    if isinstance(cluster, Client):
        return cluster, False
    if isinstance(cluster, str):
        if cluster.lower() not in KINDS:
            raise ValueError(f"cluster={cluster!r}: one of 'local', {', '.join(map(repr, KINDS))}")
        # Worker jobs come and go as the units need them; the site's job settings come
        # from dask-jobqueue's configuration (jobqueue.sge / jobqueue.htcondor).
        maximum = workers or BATCH_WORKERS
        return Client(batch_cluster(cluster, minimum=1, maximum=maximum)), True
    if hasattr(cluster, "scheduler_address"):
        return Client(cluster), False
    raise TypeError(f"cluster must be None, a distributed.Client or a cluster, got {cluster!r}")


def _tasks_by_worker(client: Client) -> dict[str, int]:
    table = pcm.status(client, [CONTEXT])
    return {r.worker: int(r.tasks) for r in table.itertuples()}


def _compute(
    client: Client,
    todo: list[Unit],
    method: str,
    store: OutputStore | None,
    model_digest: str,
    progress: bool,
    prefix_cache: bool,
) -> list[dict[str, Any]]:
    def submit(i: int, u: Unit) -> Any:
        return pcm.submit(
            client,
            score_unit,
            u.template,
            list(u.claims),
            method,
            prefix_cache=prefix_cache,
            context=CONTEXT,
            key=f"fever-{u.name}-{os.urandom(4).hex()}",
            priority=-i,
            pure=False,
        )

    futures = {submit(i, u): (i, u) for i, u in enumerate(todo)}
    resubmitted: dict[str, int] = {}
    bar = _progress_bar(len(todo), progress)
    rows: list[dict[str, Any]] = []
    try:
        queue = as_completed(futures, with_results=True, raise_errors=False)
        for future, result in queue:
            i, unit = futures.pop(future)
            if future.status == "error":
                result = future.exception()
                # Workers preempted while running the same unit, distributed's
                # allowed-failures times over: on an opportunistic cluster that is bad
                # luck more often than a unit that kills workers, so try it again a few
                # times before giving up.
                if isinstance(result, KilledWorker) and resubmitted.get(unit.name, 0) < 2:
                    resubmitted[unit.name] = resubmitted.get(unit.name, 0) + 1
                    logger.warning(
                        "Unit %s lost with its workers (%s); submitting it again", unit.name, result
                    )
                    again = submit(i, unit)
                    futures[again] = (i, unit)
                    queue.add(again)
                    continue
                raise result
            for row in result:
                row["model_digest"] = model_digest
            if store:
                store.write(unit.name, result)
            else:
                rows.extend(result)
            bar.update(1)
    except BaseException:
        client.cancel(list(futures))
        raise
    finally:
        bar.close()
    return rows


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress_bar(total: int, enabled: bool) -> Any:
    if not enabled or total == 0:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="units", unit="unit")
