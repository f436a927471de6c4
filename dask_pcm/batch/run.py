"""``run_batch``: any task function over any dataset, against contexts resident on workers.

The rows are cut into *units* (``rows_per_unit`` rows, under each *group* of parameters when
there are groups); :mod:`dask_pcm.batch.dispatch` packs units into tasks and sends them in
waves to workers whose contexts are ready; with ``output=`` every finished unit is appended
to a resumable folder (:mod:`dask_pcm.batch.store`) keyed by what determines the results
(:mod:`dask_pcm.batch.provenance`), so a killed run keeps what it finished and a rerun
computes only the rest (and starts no cluster when nothing is left).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distributed import Client

from dask_pcm import client as pcm
from dask_pcm import config
from dask_pcm.batch import cluster as clusters
from dask_pcm.batch.data import read_rows
from dask_pcm.batch.dispatch import Dispatch, raise_unit_error
from dask_pcm.batch.provenance import context_record, function_digest, rows_digest
from dask_pcm.batch.segments import read_predictions, written_schema
from dask_pcm.batch.store import OutputStore
from dask_pcm.batch.units import Layout, OutputColumns, Unit, Work, make_units
from dask_pcm.context import Context
from dask_pcm.interrupts import terminate_as_interrupt

if TYPE_CHECKING:
    import pandas as pd
    import pyarrow as pa

logger = logging.getLogger(__name__)

ON_ERROR = ("raise", "skip")


class BatchResult:
    """What :func:`run_batch` returns.

    Attributes
    ----------
    report
        ``wall_seconds``; ``units`` (``total``, ``computed`` now, ``reused`` from the
        output folder, ``failed``, ``unfinished``: left out at the ``deadline``); ``expired``
        (the deadline passed); ``tasks`` submitted; ``files`` (segments in the folder);
        ``rows``; ``lost_rows`` (rows recorded as errors because they killed their workers);
        ``workers`` (per worker and context: loads, load seconds, tasks in this run).
    output
        The output folder, or ``None``.
    errors
        One row per failed unit: ``unit``, ``type``, ``message``, ``traceback``, ``worker``,
        ``attempt``, ``ids`` (the ids of the unit's rows; ``None`` for a unit recorded by a
        dask_pcm without it) (with an output folder: every failed unit not yet redone,
        earlier runs' included).
    """

    def __init__(
        self,
        report: dict[str, Any],
        output: Path | None,
        tables: list[pa.Table],
        errors: list[dict[str, Any]],
    ) -> None:
        import pandas as pd

        self.report = report
        self.output = output
        self._tables = tables
        columns = ["unit", "type", "message", "traceback", "worker", "attempt", "ids"]
        self.errors = pd.DataFrame(errors, columns=columns)

    def to_pandas(self, columns: list[str] | None = None) -> pd.DataFrame:
        """The result rows (from the output folder when there is one), in the order they
        were written."""
        if self.output is not None:
            return read_predictions(self.output, columns=columns)
        import pandas as pd
        import pyarrow as pa

        if not self._tables:
            return pd.DataFrame(columns=columns)
        table = pa.concat_tables(self._tables, promote_options="permissive").to_pandas()
        if columns is None:
            return table
        return table.reindex(columns=columns)  # a column no row has is all missing

    def __repr__(self) -> str:
        units = self.report["units"]
        return (
            f"BatchResult({units['total']} units: {units['computed']} computed, "
            f"{units['reused']} reused, {units['failed']} failed; output={self.output})"
        )


def run_batch(
    fn: Callable[..., Any],
    data: Any,
    *,
    contexts: Context | str | Sequence[Context | str] = (),
    cluster: Any = None,
    id_column: str = "id",
    rows_per_unit: int = 16,
    groups: Mapping[str, Mapping[str, Any]] | None = None,
    group_column: str | None = None,
    carry: Sequence[str] = (),
    output: str | os.PathLike[str] | None = None,
    provenance: Mapping[str, Any] | None = None,
    accept_changes: Sequence[str] = (),
    on_error: str = "raise",
    timeout: float | None = None,
    level: str | None = None,
    workers: int | None = None,
    progress: bool = True,
    prepare: Callable[[Client, list[Unit]], Any] | None = None,
    on_unit: Callable[[str, pa.Table | None, dict[str, Any] | None], Any] | None = None,
    deadline: float | None = None,
    **fn_kwargs: Any,
) -> BatchResult:
    """Run ``fn(rows, **fn_kwargs)`` over ``data`` in units, on workers with ``contexts``.

    Parameters
    ----------
    fn
        The task function: ``fn(rows, **group_params, **fn_kwargs)`` gets a unit's rows (a
        list of dicts) on a worker where every context is ready (``dask_pcm.get_context``
        inside) and returns one row per input row, in order: a list of dicts, a pandas
        DataFrame or an Arrow table. The output rows start with the input's ``id_column``.
    data
        A JSON-lines, Parquet or CSV path, a pandas DataFrame, a list of dicts, or a dask
        DataFrame (computed on the client, a partition at a time).
    contexts
        :class:`~dask_pcm.Context` objects (registered at ``level`` for the run, recorded by
        content in the provenance) or names of contexts registered already. None (the
        default): ``fn`` needs no context and runs on any worker, with the same resume,
        errors, timeouts and isolation of rows that kill workers.
    cluster
        ``None``/``"local"``, ``"sge"``, ``"htcondor"``, a scheduler address, a
        ``distributed.Client`` or a cluster; a client or cluster of yours stays open and
        keeps its contexts for the next run.
    id_column
        The column that identifies a row: present in every row, unique.
    rows_per_unit
        Rows per unit: the grain of the output folder, of a resume and of an error.
    groups
        Parameter sets (name -> keyword arguments for ``fn``): every row runs under each.
        Units are named ``<group>--<index>``; a run may add groups to a folder.
    group_column
        A column, added to every output row, naming its group.
    carry
        Input columns copied into every output row (error rows too).
    output
        A folder of Parquet segments; rerunning with it resumes (see
        :mod:`dask_pcm.batch.store`). It must be new, empty or written by dask_pcm.
    provenance
        Keys added to (or replacing) what is recorded automatically: each context's content
        digest and loader, the function's name and ``fn_kwargs``, the rows per unit, the
        input's digest and the groups. A resume refuses a folder where any differs. A key
        given here replaces the automatic one: ``provenance={"function": "v2"}`` records
        that name for the function instead of its code digest (a later run resumes with the
        same name, whatever the code).
    accept_changes
        Provenance keys (``"function"``, ``"kwargs"``, ``"contexts"``...) whose change this
        resume accepts: you vouch that the change cannot change a result (a refactored
        function, say). The folder's results are kept and the new values recorded, so the
        next run resumes without it.
    on_error
        ``"raise"``: stop at the first unit whose function raises (or times out), naming it
        (:class:`~dask_pcm.exceptions.UnitError`). ``"skip"``: record it (``errors``, and
        ``_dask_pcm_errors.jsonl`` in the folder) and go on; a rerun tries it again.
    timeout
        Seconds one task may run (default ``pcm.batch.task-timeout``, none): past it its
        units fail as timed out and its worker is restarted through its nanny.
    level
        The level of the contexts registered here (default ``pcm.default-level``).
    workers
        Worker processes of a local cluster, or the most jobs of a batch cluster.
    progress
        A progress bar of units, and where to watch when the run starts its own cluster.
    prepare
        Called with the client and the units to compute once the contexts are registered,
        before any unit (a check of the whole input on a worker, say); may raise.
    on_unit
        Called on the client as each unit of this run is written: ``on_unit(name, table,
        None)`` with its rows, or ``on_unit(name, None, record)`` for a unit that failed
        (``record`` as in ``errors``, with its ``ids``); an application's own account of
        the run (a status file, say). It runs in the dispatch loop: keep it quick.
    deadline
        Seconds the run may take from its start: past them nothing more is submitted, what
        runs is cancelled, and the run returns with what finished by then
        (``report["expired"]``, ``report["units"]["unfinished"]``); a rerun with the same
        output folder does the rest.

    Returns
    -------
    BatchResult

    Examples
    --------
    >>> def shout(rows, suffix):
    ...     lm = dask_pcm.get_context("llm")
    ...     return [{"text": lm.complete(r["prompt"]) + suffix} for r in rows]
    >>> result = dask_pcm.run_batch(                                      # doctest: +SKIP
    ...     shout, "prompts.jsonl", contexts=dask_pcm.causal_lm(name="llm"),
    ...     output="answers", on_error="skip", suffix="!")
    >>> result.to_pandas().head()                                         # doctest: +SKIP
    """
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error must be 'raise' or 'skip', not {on_error!r}")
    if rows_per_unit < 1:
        raise ValueError(f"rows_per_unit must be at least 1, got {rows_per_unit}")
    if workers is not None and workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    level = config.check_level(level) if level is not None else config.default_level()
    if timeout is None:
        timeout = config.batch_seconds("task-timeout")
    declared = _contexts(contexts)
    rows, path = read_rows(data, id_column)
    layout = Layout(id_column, group_column, tuple(carry))
    units = make_units(rows, rows_per_unit, groups)
    automatic = record(fn, fn_kwargs, rows, rows_per_unit, groups, declared, layout, path)
    given = dict(provenance or {})
    info = {**automatic["info"], **given.pop("info", {})}
    recorded = _json({**automatic, **given, "info": info})  # as the folder will hold it
    work = Work(fn, fn_kwargs, tuple(declared), layout, timeout)
    start = time.perf_counter()
    tables: list[pa.Table] = []
    failures: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        # SIGTERM (walltime, docker stop, kill PID) unwinds like Ctrl-C: what finished is kept.
        stack.enter_context(terminate_as_interrupt())
        store = (
            stack.enter_context(OutputStore(output, recorded, accept_changes=accept_changes))
            if output
            else None
        )
        done = store.done() if store else set()
        todo = [u for u in units if u.name not in done]

        rows_of = {u.name: u.rows for u in units}

        def failed(name: str, record: dict[str, Any]) -> None:
            if on_error == "raise":
                raise_unit_error(name, record)
            # The unit's ids, so that an application can say which of its rows went unanswered.
            record = {**record, "ids": _json([r[id_column] for r in rows_of.get(name, ())])}
            failures.append({"unit": name, **record})
            if store:
                store.add_error(name, record)
            if on_unit is not None:
                on_unit(name, None, record)

        sink = _Sink(store, tables, failed, written_schema(output) if output else None, on_unit)
        ends = None if deadline is None else time.monotonic() + deadline
        # A resume with nothing left to compute starts no cluster and loads no model.
        outcome = _compute(
            cluster, workers, declared, level, todo, work, sink, progress, prepare, ends
        )
    report = {
        "wall_seconds": time.perf_counter() - start,
        "units": {
            "total": len(units),
            "computed": len(todo),
            "reused": len(units) - len(todo),
            "failed": len(failures),
            "unfinished": outcome.get("unfinished", 0),
        },
        "expired": outcome.get("expired", False),
        "tasks": outcome.get("tasks", 0),
        "files": store.files if store else 0,
        "rows": len(rows),
        "lost_rows": outcome.get("lost_rows", 0),
        "workers": outcome.get("workers", []),
    }
    errors = list(store.errors().values()) if store else failures
    return BatchResult(report, Path(output) if output else None, tables, errors)


@dataclasses.dataclass
class _Sink:
    """Where finished and failed units go."""

    store: OutputStore | None
    tables: list[Any]
    failed: Callable[[str, dict[str, Any]], None]
    written: pa.Schema | None = None  # the columns of the folder's segments, on a resume
    on_unit: Callable[[str, pa.Table | None, dict[str, Any] | None], Any] | None = None

    def finished(self, name: str, table: pa.Table) -> None:
        if self.store:
            self.store.add(name, table)
        else:
            self.tables.append(table)
        if self.on_unit is not None:
            self.on_unit(name, table, None)

    def tick(self) -> None:
        if self.store:
            self.store.flush_if_due()

    def flush(self) -> None:
        if self.store:
            self.store.flush()


def _compute(
    cluster: Any,
    workers: int | None,
    declared: dict[str, Context | None],
    level: str,
    todo: list[Unit],
    work: Work,
    sink: _Sink,
    progress: bool,
    prepare: Callable[[Client, list[Unit]], Any] | None,
    deadline: float | None = None,
) -> dict[str, Any]:
    """Register the contexts and run ``todo``: tasks, lost rows and the workers' report."""
    if not todo:
        return {}
    # A loader that runs one engine per worker on all its threads (vLLM) wants the cores of
    # a local cluster shared among few workers, not one worker per core.
    whole = any(getattr(c.loader, "one_engine_per_worker", False) for c in declared.values() if c)
    names = list(declared)
    with contextlib.ExitStack() as stack:  # closed in reverse: bar, flush, cluster, copies
        # A local cluster that the run starts: the host's template copies meanwhile.
        copies = clusters.HostCopies.for_run(cluster, declared.values(), level)
        stack.callback(copies.release)
        client, close = clusters.open_client(cluster, workers, progress, whole_cores=whole)
        stack.callback(close)
        # What finished reaches the disk before the cluster closes (seconds, or a hang on
        # a sick cluster), not after: a walltime's SIGKILL may follow a SIGTERM soon.
        stack.callback(sink.flush)
        bar = clusters.progress_bar(len(todo), progress)
        stack.callback(bar.close)
        copies.wait_listed()
        _register(client, declared, level)
        if prepare is not None:
            prepare(client, todo)
        dispatch = Dispatch(
            client, todo, work, sink.finished, sink.failed, bar.update, on_tick=sink.tick,
            columns=OutputColumns(sink.written), deadline=deadline,
        )  # fmt: skip
        dispatch.run()
        report = clusters.workers_report(client, names, dispatch.served)
    return {
        "tasks": dispatch.tasks,
        "lost_rows": dispatch.lost_rows,
        "workers": report,
        "expired": dispatch.expired,
        "unfinished": dispatch.unfinished,
    }


def _contexts(contexts: Any) -> dict[str, Context | None]:
    """Name -> Context (to register) or ``None`` (registered already, by name)."""
    items = [contexts] if isinstance(contexts, Context | str) else list(contexts)
    out: dict[str, Context | None] = {}
    for item in items:
        if isinstance(item, Context):
            out[item.name] = item
        elif isinstance(item, str):
            out[item] = None
        else:
            raise TypeError(f"contexts: expected a Context or a name, got {item!r}")
    return out


def _register(client: Client, declared: dict[str, Context | None], level: str) -> None:
    missing = [n for n, c in declared.items() if c is None]
    if missing:
        known = set(pcm.registered_contexts(client))
        unknown = [n for n in missing if n not in known]
        if unknown:
            raise ValueError(
                f"context(s) {', '.join(map(repr, unknown))} are not registered on "
                f"{getattr(client.scheduler, 'address', 'the cluster')}: pass Context objects, "
                "or register them first"
            )
    contexts = [c for c in declared.values() if c is not None]
    if contexts:
        # Work starts on the first worker ready; the others get tasks as they finish loading.
        pcm.register(client, *contexts, level=level, wait="first")
    elif not declared:  # a function that needs no context: any worker runs it
        pcm.install_scheduler_plugin(client)


def record(
    fn: Callable[..., Any],
    fn_kwargs: Mapping[str, Any],
    rows: list[dict[str, Any]],
    rows_per_unit: int,
    groups: Mapping[str, Mapping[str, Any]] | None,
    declared: dict[str, Context | None],
    layout: Layout,
    path: str | None,
) -> dict[str, Any]:
    """The provenance recorded automatically (see :mod:`dask_pcm.batch.provenance`)."""
    contexts: dict[str, Any] = {}
    files: dict[str, dict[str, str]] = {}
    for name, c in declared.items():
        contexts[name], files[name] = (None, {}) if c is None else context_record(c)
    return {
        "function": function_digest(fn),
        "kwargs": _json(fn_kwargs),
        "input": rows_digest(rows),
        "rows_per_unit": rows_per_unit,
        "layout": dataclasses.asdict(layout),
        "contexts": contexts,
        "groups": _json(groups or {}),
        "info": {
            "input": path,
            "contexts": {n: None if c is None else str(c.template) for n, c in declared.items()},
            "files": files,  # per context, each file's SHA-256: names the file that changed
        },
    }


def _json(value: Any) -> Any:
    """``value`` as JSON would give it back (objects by their repr)."""
    return json.loads(json.dumps(value, sort_keys=True, default=repr))
