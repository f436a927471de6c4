"""The task of a batch run (``run_units``): a task's units come back as one Arrow table, cut
into the units' tables on the client, and a unit that raises, or whose rows no table holds,
is an error of that unit alone."""

from __future__ import annotations

import pyarrow as pa
import pytest

from dask_pcm.batch.units import Layout, WaveRows, run_units, unit_tables

LAYOUT = Layout("id", "group")
ROWS = WaveRows(tuple({"id": i, "text": f"row {i}"} for i in range(12)), {"g": {"times": 2}})
UNITS = [("g--00000", 0, 4), ("g--00001", 4, 8), ("g--00002", 8, 12)]


def _run(fn):
    return run_units(fn, ROWS, UNITS, "g", {}, LAYOUT)


def test_the_units_travel_as_one_table_and_come_back_as_their_own_rows():
    def shout(rows, times):
        return [{"out": r["text"].upper() * times} for r in rows]

    result = _run(shout)
    assert isinstance(result["table"], pa.Table) and result["table"].num_rows == 12
    tables = unit_tables(result)
    assert [name for name, _ in tables] == [u[0] for u in UNITS]
    for (_, begin, end), (_, table) in zip(UNITS, tables, strict=True):
        assert table.to_pylist() == [
            {"id": i, "group": "g", "out": f"ROW {i}ROW {i}"} for i in range(begin, end)
        ]


def test_a_unit_that_raises_is_its_error_and_the_others_keep_their_rows():
    def picky(rows, times):
        if rows[0]["id"] == 4:
            raise RuntimeError("row 4 is bad")
        return [{"n": r["id"] * times} for r in rows]

    result = _run(picky)
    tables = dict(unit_tables(result))
    assert tables["g--00001"] is None
    assert result["errors"]["g--00001"]["message"] == "row 4 is bad"
    assert [r["n"] for r in tables["g--00002"].to_pylist()] == [16, 18, 20, 22]
    assert [r["n"] for r in tables["g--00000"].to_pylist()] == [0, 2, 4, 6]


def test_a_column_only_later_rows_have_is_kept():
    """Arrow names a table's columns by its first row: a column the first row lacked used to
    be dropped from the unit's output."""

    def later(rows, times):
        return [{"note": "late"} if r["id"] == 6 else {} for r in rows]

    tables = dict(unit_tables(_run(later)))
    assert tables["g--00001"].column("note").to_pylist() == [None, None, "late", None]
    assert tables["g--00000"].column("note").to_pylist() == [None] * 4


def test_units_whose_values_no_one_column_holds_come_back_one_table_each():
    def mixed(rows, times):
        first = rows[0]["id"]
        if first == 8:  # within the unit: an int and a text in one column
            return [{"v": 1 if r["id"] == 8 else "x"} for r in rows]
        return [{"v": first} if first == 0 else {"v": "four"} for _ in rows]

    result = _run(mixed)
    assert "table" not in result
    tables = dict(unit_tables(result))
    assert tables["g--00000"].column("v").to_pylist() == [0] * 4
    assert tables["g--00001"].column("v").to_pylist() == ["four"] * 4
    assert tables["g--00002"] is None
    assert result["errors"]["g--00002"]["type"] == "TypeError"
    assert (
        "column 'v' holds int 1 in the row with id 8 and str 'x'"
        in (result["errors"]["g--00002"]["message"])
    )


@pytest.mark.parametrize("returned", ["text", 7])
def test_a_unit_that_returns_no_rows_is_named(returned):
    result = _run(lambda rows, times: returned)
    assert all(table is None for _, table in unit_tables(result))
    assert "unit g--00000: the function returned" in result["errors"]["g--00000"]["message"]
