"""``run_fever``: which prompt template makes a language model the best fact checker?

The work is a grid of *units*, one per (template, batch of ``claims_per_task`` claims); each
returns one prediction row per claim, computed by the resident model context
(:func:`dask_pcm.get_context`). :mod:`dask_pcm.fever.dispatch` packs units into tasks and
sends them in waves; with ``output=`` every finished unit is appended to the output folder
(:mod:`dask_pcm.fever.store`: locked for the run, a few hundred Parquet segments however many
units, resume keyed on what determines a prediction), so a run that is killed keeps what it
finished, a rerun computes only the missing units (and starts no cluster when none are), and
no row is written twice. The summary is computed from the output folder.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from distributed import Client

from dask_pcm import client as pcm
from dask_pcm import config
from dask_pcm.context import causal_lm
from dask_pcm.deploy import KINDS
from dask_pcm.deploy.local import local_cluster
from dask_pcm.deploy.start import batch_cluster
from dask_pcm.fever.data import LABELS, ClaimSet, demo_claims, load_claims, sample_claims
from dask_pcm.fever.dispatch import Dispatch
from dask_pcm.fever.fitting import RowErrors, refuse_unfit
from dask_pcm.fever.result import FeverResult, in_order, summarize, to_pandas
from dask_pcm.fever.scoring import check_method
from dask_pcm.fever.segments import read_predictions
from dask_pcm.fever.store import OutputStore
from dask_pcm.fever.templates import PromptTemplate, get_templates
from dask_pcm.fever.units import CONTEXT, Unit, make_units, provenance
from dask_pcm.interrupts import terminate_as_interrupt

if TYPE_CHECKING:
    import pyarrow as pa

logger = logging.getLogger(__name__)


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
    truncate: bool | None = None,
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
    if truncate is None:
        truncate = bool(config.get("fever.truncate"))
    claims = demo_claims() if data is None else load_claims(data, errors=errors)  # type: ignore[arg-type]
    if limit is not None:
        claims = sample_claims(claims, limit, seed=seed)
    chosen = get_templates(templates, num_templates)
    units = make_units(chosen, claims, claims_per_task)
    context = causal_lm(model, name=CONTEXT)
    recorded = provenance(context, claims, chosen, method, claims_per_task)

    names = [t.name for t in chosen]
    start = time.perf_counter()
    tables: list[pa.Table] = []
    errors_seen = RowErrors(claims)
    with contextlib.ExitStack() as stack:
        # SIGTERM (walltime, docker stop, kill PID) unwinds like Ctrl-C: what finished is kept.
        stack.enter_context(terminate_as_interrupt())
        store = stack.enter_context(OutputStore(output, recorded)) if output else None
        done = store.done() if store else set()
        todo = [u for u in units if u.name not in done]
        digest = recorded["model_digest"]

        def finished(name: str, table: pa.Table) -> None:
            errors_seen.add(table)
            table = _with_digest(table, digest)
            if store:
                store.add(name, table)
            else:
                tables.append(table)

        job = _Job(
            todo=todo,
            templates=chosen,
            claims=claims,
            options={"method": method, "prefix_cache": prefix_cache, "truncate": truncate},
            errors=errors,
            model=str(context.template),
            finished=finished,
            tick=store.flush_if_due if store else (lambda: None),
            flush=store.flush if store else (lambda: None),
        )
        # A resume with nothing left to compute starts no cluster and loads no model.
        workers_report, tasks = (
            _compute(cluster, workers, context, level, job, progress) if todo else ([], 0)
        )
    report = {
        "wall_seconds": time.perf_counter() - start,
        "units": {"total": len(units), "computed": len(todo), "reused": len(units) - len(todo)},
        "tasks": tasks,
        "files": store.files if store else 0,
        "claims": len(claims),
        "skipped_lines": claims.skipped,
        "row_errors": errors_seen.count,
        "row_error_examples": errors_seen.examples,
        "truncated": errors_seen.truncated,
        "workers": workers_report,
    }
    if errors_seen.count:
        logger.warning(
            "%d row(s) recorded as errors, without a prediction: %s",
            errors_seen.count,
            "; ".join(errors_seen.examples),
        )
    if output is not None:
        # The summary reads only the columns it needs, from the folder: the run kept no rows.
        columns = ["template", "claim_id", "label", "predicted", "error"]
        if method == "logits":
            columns += [f"score_{label}" for label in LABELS]
        predictions = None
        summary = summarize(read_predictions(output, names, columns))
    else:
        predictions = in_order(to_pandas(tables), names)
        summary = summarize(predictions)
    return FeverResult(summary, predictions, report, output=output, templates=names)


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


@dataclass
class _Job:
    """What :func:`_compute` scores, and where the rows go."""

    todo: list[Unit]
    templates: list[PromptTemplate]
    claims: ClaimSet
    options: dict[str, Any]
    errors: str
    model: str
    finished: Callable[[str, pa.Table], None]
    tick: Callable[[], Any]
    flush: Callable[[], Any]


def _compute(
    cluster: Any, workers: int | None, context: Any, level: str, job: _Job, progress: bool
) -> tuple[list[dict[str, Any]], int]:
    """Register the model on the cluster and score ``job.todo``; returns the report's
    per-worker rows and the number of tasks submitted."""
    client, owned = _client(cluster, workers)
    if owned and progress:
        # Where to watch: the cluster is ours, so the user has no other way to know.
        print(
            f"Dask dashboard: {client.dashboard_link}\nContexts:       {pcm.status_page(client)}",
            file=sys.stderr,
            flush=True,
        )
    bar = _progress_bar(len(job.todo), progress)
    try:
        pcm.register(client, context, level=level)
        refuse_unfit(
            client,
            job.templates,
            job.claims,
            job.options["method"],
            job.errors,
            job.options["truncate"],
            job.model,
        )
        before = _tasks_by_worker(client)
        dispatch = Dispatch(
            client, job.todo, job.options, job.finished, bar.update, on_tick=job.tick
        )
        dispatch.run()
        after = pcm.status(client, [CONTEXT])
    finally:
        bar.close()
        try:
            # What finished reaches the disk before the cluster closes (seconds, or a hang
            # on a sick cluster), not after: a walltime's SIGKILL may follow a SIGTERM soon.
            job.flush()
        finally:
            if owned:
                _close(client)
    rows = [
        {
            "worker": r.worker,
            "context": r.context,
            "loads": int(r.loads),
            "load_seconds": float(r.load_seconds),
            "tasks": int(r.tasks) - before.get(r.worker, 0),
        }
        for r in after.itertuples()
    ]
    return rows, dispatch.tasks


def _close(client: Client) -> None:
    cluster = client.cluster
    client.close()
    if cluster is not None:
        cluster.close()


def _tasks_by_worker(client: Client) -> dict[str, int]:
    table = pcm.status(client, [CONTEXT])
    return {r.worker: int(r.tasks) for r in table.itertuples()}


def _with_digest(table: pa.Table, digest: str) -> pa.Table:
    import pyarrow as pa

    return table.append_column("model_digest", pa.array([digest] * table.num_rows, pa.string()))


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
