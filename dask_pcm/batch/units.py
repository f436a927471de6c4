"""Units of a batch run, and the task that runs them on a worker.

A *unit* is a slice of ``rows_per_unit`` consecutive rows of the input under one *group* (a
parameter set of the run, such as a prompt template; runs without groups have one). It is
the grain of the output folder and of a resume: ``<group>--<index>``, or ``unit-<index>``.
:func:`run_units` is the task the dispatch submits: it calls the user's function once per
unit, on a worker whose contexts are ready, and returns each unit's rows as an Arrow table,
or what went wrong. A task names its units' rows by index ranges into the :class:`WaveRows`
of its wave (one graph key the dispatch sends once for all the wave's tasks), so that no task
message carries row text.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pyarrow as pa

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Unit:
    """Rows of the input run together under one group.

    Attributes
    ----------
    name
        ``<group>--<index:05d>``, or ``unit-<index:05d>`` without groups.
    rows
        The unit's rows (dicts of the input's columns), in input order.
    group
        The group's name, or ``None``.
    params
        The group's keyword arguments for the task function.
    """

    name: str
    rows: tuple[Any, ...]
    group: str | None = None
    params: Mapping[str, Any] = field(default_factory=dict)


def make_units(
    rows: Sequence[Any], rows_per_unit: int, groups: Mapping[str, Mapping[str, Any]] | None
) -> list[Unit]:
    """Every (group, slice of ``rows_per_unit`` rows), group by group."""
    slices = [tuple(rows[i : i + rows_per_unit]) for i in range(0, len(rows), rows_per_unit)]
    if not groups:
        return [Unit(f"unit-{i:05d}", part) for i, part in enumerate(slices)]
    return [
        Unit(f"{name}--{i:05d}", part, name, dict(params))
        for name, params in groups.items()
        for i, part in enumerate(slices)
    ]


@dataclass(frozen=True)
class Layout:
    """How a unit's output rows are keyed: the input's id column, the column naming the
    group (``None``: none added) and input columns carried into every output row."""

    id_column: str
    group_column: str | None = None
    carry: tuple[str, ...] = ()

    def keys(self, rows: Sequence[Any], group: str | None) -> list[dict[str, Any]]:
        """What every output row of ``rows`` starts with (error rows too)."""
        keys = []
        for row in rows:
            key = {self.id_column: row.get(self.id_column)}
            if self.group_column:
                key[self.group_column] = group
            key.update({c: row.get(c) for c in self.carry})
            keys.append(key)
        return keys


@dataclass(frozen=True)
class Work:
    """What every task of a run calls: ``fn(rows, **group_params, **kwargs)`` on a worker
    where ``contexts`` are ready, its rows keyed by ``layout``; ``timeout``: seconds a task
    may run (``None``: no limit)."""

    fn: Callable[..., Any]
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    contexts: tuple[str, ...] = ()
    layout: Layout = field(default_factory=lambda: Layout("id"))
    timeout: float | None = None


@dataclass(frozen=True)
class WaveRows:
    """The rows of one wave of tasks, and the parameters of the groups they run under.

    The dispatch sends it to the workers once, as one graph key, and each task of the wave
    carries index ranges into ``rows``: the scheduler, and the message logs distributed keeps
    of what it sends, hold keys and numbers per task, not row text.
    """

    rows: tuple[Any, ...]
    params: Mapping[str | None, Mapping[str, Any]] = field(default_factory=dict)


def run_units(
    fn: Callable[..., Any],
    wave: WaveRows,
    units: Sequence[tuple[str, int, int]],
    group: str | None,
    kwargs: Mapping[str, Any],
    layout: Layout,
) -> dict[str, Any]:
    """The task: ``fn(rows, **params, **kwargs)`` for each (name, start, stop) of ``units``,
    ``rows`` being ``wave.rows[start:stop]`` and ``params`` ``wave.params[group]``.

    Returns ``units``: (name, rows) per unit, or (name, ``None``) for a unit whose call
    raised, with what it raised in ``errors`` (name -> type, message, traceback, worker);
    ``table``, the rows of all the units that did not raise, in order, as one Arrow table
    (:func:`unit_tables` cuts it into the units' tables: one table travels and is
    deserialised far faster than one per unit); ``seconds``, the time the calls took (the
    dispatch sizes its tasks by it); and ``worker``, the address of the worker that ran it
    (the run's report counts tasks per worker by it). One unit's exception does not cost
    the others of the task.
    """
    start = time.perf_counter()
    out: list[tuple[str, int | None]] = []
    records: list[list[dict[str, Any]]] = []
    errors: dict[str, dict[str, Any]] = {}
    params = wave.params.get(group, {})
    for name, begin, end in units:
        rows = wave.rows[begin:end]
        try:
            result = fn(list(rows), **params, **kwargs)
            done = output_rows(result, layout.keys(rows, group), name)
        except Exception as exc:
            errors[name] = _error(exc)
            out.append((name, None))
            continue
        out.append((name, len(done)))
        records.append(done)
    outcome: dict[str, Any] = {"units": out, "errors": errors}
    try:
        outcome["table"] = _table([row for done in records for row in done], layout.id_column)
    except (TypeError, ValueError) as exc:  # values of one column that no one type holds
        outcome["tables"] = _each(out, records, errors, exc, layout.id_column)
    outcome["seconds"] = time.perf_counter() - start
    outcome["worker"] = _worker_address()
    return outcome


def _each(
    units: list[tuple[str, int | None]],
    records: list[list[dict[str, Any]]],
    errors: dict[str, dict[str, Any]],
    why: Exception,
    id_column: str,
) -> list[pa.Table | None]:
    """A table per unit, when the units' rows do not make one table (``why``); a unit whose
    own rows do not make one is an error."""
    tables: list[pa.Table | None] = []
    done = iter(records)
    for i, (name, rows) in enumerate(units):
        if rows is None:
            tables.append(None)
            continue
        try:
            tables.append(_table(next(done), id_column))
        except (TypeError, ValueError) as exc:
            errors[name] = _error(exc)
            units[i] = (name, None)
            tables.append(None)
    logger.debug("The units' rows are not one table (%s): one table per unit", why)
    return tables


def _error(exc: Exception) -> dict[str, Any]:
    return {
        "type": type(exc).__name__,
        "message": str(exc),
        "traceback": traceback.format_exc(),
        "worker": _worker_address(),
    }


def unit_tables(result: Mapping[str, Any]) -> list[tuple[str, pa.Table | None]]:
    """(name, Arrow table) per unit of a :func:`run_units` result, ``None`` for one that
    raised: slices of its one table, not copies."""
    if result.get("tables") is not None:
        return [(name, t) for (name, _), t in zip(result["units"], result["tables"], strict=True)]
    out: list[tuple[str, pa.Table | None]] = []
    offset = 0
    for name, rows in result["units"]:
        if rows is None:
            out.append((name, None))
            continue
        out.append((name, result["table"].slice(offset, rows)))
        offset += rows
    return out


def output_rows(result: Any, keys: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    """``result`` (a list of dicts, a pandas DataFrame or an Arrow table, one row per input
    row in order) as output rows: each starts with its ``keys``' columns (kept where the
    result has them)."""
    import pyarrow as pa

    if isinstance(result, pa.Table):
        rows = result.to_pylist()
    elif hasattr(result, "to_dict") and hasattr(result, "columns"):
        rows = result.to_dict("records")
    elif isinstance(result, Sequence) and not isinstance(result, str | bytes):
        rows = list(result)
    else:
        raise TypeError(
            f"unit {name}: the function returned {type(result).__name__}; return a list of "
            "dicts, a pandas DataFrame or an Arrow table, one row per input row"
        )
    if len(rows) != len(keys):
        raise ValueError(
            f"unit {name}: the function returned {len(rows)} rows for {len(keys)} input rows"
        )
    for number, (key, row) in enumerate(zip(keys, rows, strict=True), start=1):
        if not isinstance(row, Mapping):
            raise TypeError(f"unit {name}: a row is {type(row).__name__}, not a dict")
        for column, value in key.items():
            if column in row and not _same(row[column], value):
                raise ValueError(
                    f"unit {name}: returned row {number} has {column} {row[column]!r} where "
                    f"input row {number} has {value!r}: return one row per input row, in "
                    f"order, with its {column!r} (or leave the column out: it is added)"
                )
    return [{**key, **row} for key, row in zip(keys, rows, strict=True)]


def _same(returned: Any, given: Any) -> bool:
    """Whether a key value the function returned is the one it was given (the same value
    through a DataFrame may come back as another number type, or NaN for a missing one)."""
    try:
        if returned == given:
            return True
    except Exception:  # an array's comparison, say
        return False
    both_missing = all(v is None or (isinstance(v, float) and v != v) for v in (returned, given))
    return both_missing


def _table(rows: Sequence[Mapping[str, Any]], id_column: str | None = None) -> pa.Table:
    """``rows`` as an Arrow table: a column for every key of any row, in the order they
    first appear, missing values null.

    Raises
    ------
    TypeError
        A column's values fit no one type (an int in one row, a string in another): the
        message names the column and two rows that differ (by ``id_column`` where given).
    """
    import pyarrow as pa

    if rows and len(set().union(*rows)) > len(rows[0]):  # Arrow names columns by row one
        names = dict.fromkeys(key for row in rows for key in row)
        rows = [{n: rows[0].get(n) for n in names}, *rows[1:]]
    try:
        return pa.Table.from_pylist(list(rows))
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError) as exc:
        raise TypeError(_mixed_column(rows, id_column) or str(exc)) from exc


def _mixed_column(rows: Sequence[Mapping[str, Any]], id_column: str | None) -> str | None:
    """Which column of ``rows`` Arrow cannot make one type of, and two rows that show it."""
    import pyarrow as pa

    for column in dict.fromkeys(key for row in rows for key in row):
        values = [row.get(column) for row in rows]
        try:
            pa.array(values)
            continue
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError):
            pass
        first = next(i for i, v in enumerate(values) if v is not None)
        kind = type(values[first])
        other = next(
            (i for i, v in enumerate(values) if v is not None and type(v) is not kind), None
        )
        if other is None:  # one Python type Arrow still refuses (nested values, say)
            return f"column {column!r} holds values Arrow cannot store ({kind.__name__})"

        def where(i: int) -> str:
            if id_column and id_column in rows[i]:
                return f"the row with {id_column} {rows[i][id_column]!r}"
            return f"row {i + 1}"

        return (
            f"column {column!r} holds {kind.__name__} {values[first]!r} in {where(first)} "
            f"and {type(values[other]).__name__} {values[other]!r} in {where(other)}: a "
            "column takes one type; convert its values in the function (e.g. with str())"
        )
    return None


class OutputColumns:
    """The type of each output column so far in a run, and the unit that set it: a unit
    whose column needs another type (a string where earlier units wrote integers) is that
    unit's error, not a failure of the whole output when its rows are put together.
    Numbers widen (integers and floats make floats) and a column of nulls takes any type,
    as when segments are read back."""

    def __init__(self, written: pa.Schema | None = None) -> None:
        self._schema = written  # the output folder's columns, on a resume
        self._set_by = {c: "the output folder" for c in written.names} if written else {}

    def admit(self, name: str, table: pa.Table) -> str | None:
        """Take unit ``name``'s ``table`` into the run's columns; why not, if it does not fit."""
        import pyarrow as pa

        if self._schema is None:
            merged = table.schema
        else:
            try:
                merged = pa.unify_schemas(
                    [self._schema, table.schema], promote_options="permissive"
                )
            except (pa.ArrowInvalid, pa.ArrowTypeError):
                return self._misfit(name, table)
        for column in table.schema:
            if not pa.types.is_null(column.type):
                self._set_by.setdefault(column.name, f"unit {name}")
        self._schema = merged
        return None

    def _misfit(self, name: str, table: pa.Table) -> str:
        import pyarrow as pa

        assert self._schema is not None
        for column in table.schema:
            if column.name not in self._schema.names:
                continue
            known = self._schema.field(column.name).type
            try:
                pa.unify_schemas(
                    [pa.schema([pa.field(column.name, known)]), pa.schema([column])],
                    promote_options="permissive",
                )
            except (pa.ArrowInvalid, pa.ArrowTypeError):
                return (
                    f"unit {name}: column {column.name!r} is {column.type} here but "
                    f"{known} in {self._set_by.get(column.name, 'an earlier unit')}: a column "
                    "takes one type across the run; convert its values in the function (e.g. "
                    "with str())"
                )
        return f"unit {name}: its columns do not fit those of the units before it"


def error_rows(unit: Unit, message: str, layout: Layout) -> pa.Table:
    """``unit``'s rows recorded as errors: their keys and ``error``, no result."""
    import pyarrow as pa

    rows = [{**key, "error": message} for key in layout.keys(unit.rows, unit.group)]
    return pa.Table.from_pylist(rows)


def _worker_address() -> str | None:
    from distributed import get_worker

    try:
        return str(get_worker().address)
    except ValueError:
        return None
