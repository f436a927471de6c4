"""The input of a batch run, as rows: from a file, a pandas or dask DataFrame, or dicts.

:func:`read_rows` returns the rows as a list of dicts, in input order, and checks the id
column (present in every row, unique). Files: JSON lines (``.jsonl``, ``.json``, ``.ndjson``),
Parquet (``.parquet``, or a folder of them) and CSV (``.csv``, ``.tsv``). A dask DataFrame is
computed on the client one partition at a time (the units are made before the run, so the
rows must fit in the client's memory; Arrow-backed dicts of a few million short rows do).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from dask_pcm.exceptions import BatchInputError

JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")
CSV_SUFFIXES = (".csv", ".tsv")


def read_rows(data: Any, id_column: str) -> tuple[list[dict[str, Any]], str | None]:
    """The rows of ``data`` and where they came from (a path, or ``None``).

    Raises
    ------
    BatchInputError
        Unreadable input (the message names the file, and the line for JSON lines), a row
        without ``id_column``, or an id seen twice (naming both rows).
    """
    path: str | None = None
    lines: list[int] | None = None
    if isinstance(data, str | os.PathLike):
        path = str(data)
        rows, lines = _read_file(Path(data))
    elif hasattr(data, "to_delayed") and hasattr(data, "npartitions"):  # a dask DataFrame
        rows = []
        for part in data.to_delayed():
            rows.extend(part.compute().to_dict("records"))
    elif hasattr(data, "to_dict") and hasattr(data, "columns"):  # a pandas DataFrame
        rows = data.to_dict("records")
    elif isinstance(data, list | tuple):
        rows = list(data)
    else:
        raise TypeError(
            f"data must be a path, a pandas or dask DataFrame or a list of dicts, not "
            f"{type(data).__name__}"
        )
    check_ids(rows, id_column, path, lines)
    return rows, path


def check_ids(
    rows: list[Any], id_column: str, path: str | None, lines: list[int] | None = None
) -> None:
    """Every row a dict with ``id_column``, an id that is not missing (``None``, NaN), no id
    twice; ``lines``: each row's line in the file at ``path``, for the messages."""
    seen: dict[Any, int] = {}
    for number, row in enumerate(rows, start=1):
        if lines is not None:
            where = f"{path}:{lines[number - 1]}"
        else:
            where = f"{path}: row {number}" if path else f"row {number}"
        if not isinstance(row, dict):
            raise BatchInputError(f"{where} is {type(row).__name__}, not a dict")
        if id_column not in row:
            raise BatchInputError(
                f"{where} has no {id_column!r} column (columns: {', '.join(map(str, row))}); "
                "name the id column with id_column="
            )
        key = row[id_column]
        if key is None or (isinstance(key, float) and math.isnan(key)):
            raise BatchInputError(
                f"{where}: the id ({id_column!r}) is missing ({key!r}); every row needs one"
            )
        try:
            first = seen.setdefault(key, number)
        except TypeError:
            raise BatchInputError(f"{where}: id {key!r} is not hashable") from None
        if first != number:
            raise BatchInputError(f"{where}: id {key!r} again (first in row {first})")


def _read_file(path: Path) -> tuple[list[dict[str, Any]], list[int] | None]:
    """The rows of the file at ``path`` and the line each starts on (``None`` for
    Parquet)."""
    if not path.exists():
        raise BatchInputError(f"{path}: no such file or folder")
    suffix = path.suffix.lower()
    try:
        if suffix in JSON_SUFFIXES:
            return _read_json_lines(path)
        if suffix == ".parquet" or path.is_dir():
            import pyarrow.parquet as pq

            return list(pq.read_table(path).to_pylist()), None
        if suffix in CSV_SUFFIXES:
            import pandas as pd

            frame = pd.read_csv(path, sep="\t" if suffix == ".tsv" else ",")
            # Line 1 is the header (a quoted field over several lines shifts the rest).
            return list(frame.to_dict("records")), list(range(2, len(frame) + 2))
    except BatchInputError:
        raise
    except (OSError, ValueError) as exc:
        raise BatchInputError(f"{path}: cannot read it: {exc}") from exc
    raise BatchInputError(
        f"{path}: unknown format {suffix!r}; give JSON lines ({', '.join(JSON_SUFFIXES)}), "
        f"Parquet (.parquet) or CSV ({', '.join(CSV_SUFFIXES)})"
    )


def _read_json_lines(path: Path) -> tuple[list[dict[str, Any]], list[int]]:
    rows = []
    lines = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                text = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise BatchInputError(
                    f"{path}:{number}: not valid UTF-8 (at byte {e.start})"
                ) from None
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as e:
                raise BatchInputError(
                    f"{path}:{number}: invalid JSON ({e.msg} at column {e.colno})"
                ) from None
            if not isinstance(row, dict):
                raise BatchInputError(f"{path}:{number}: expected a JSON object")
            try:
                json.dumps(row).encode("utf-8")
            except UnicodeEncodeError:
                raise BatchInputError(
                    f"{path}:{number}: not valid Unicode (a lone surrogate)"
                ) from None
            rows.append(row)
            lines.append(number)
    return rows, lines
