"""The segments of an output folder: Parquet files of finished units, and their index.

A segment (``part-000012.parquet``) holds the rows of many units. Which units, and how many
rows each, is written twice: in the file's own Parquet footer (key ``dask_pcm_units``), and
as a line appended to the folder's index (``_dask_pcm_index.jsonl``) after the file is in
place. A resume reads the index and one directory listing, and opens a segment's footer only
when the listing and the index disagree about it (a run killed between renaming a segment
and indexing it, a damaged file); it never opens every part.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dask_pcm.exceptions import OutputFolderError

if TYPE_CHECKING:
    import pandas as pd
    import pyarrow as pa

logger = logging.getLogger(__name__)

INDEX = "_dask_pcm_index.jsonl"
PATTERN = "part-*.parquet"
#: The Parquet footer key listing a segment's units (JSON: unit name -> rows).
UNITS_KEY = b"dask_pcm_units"


@dataclass
class Segment:
    """One segment file: its name in the folder, its units (name -> rows) and its size."""

    name: str
    units: dict[str, int] = field(default_factory=dict)
    bytes: int = 0

    @property
    def rows(self) -> int:
        return sum(self.units.values())

    def entry(self, units: Iterable[str] | None = None) -> dict[str, Any]:
        """The index line for this segment, listing ``units`` (default: all of them)."""
        listed = self.units if units is None else {u: self.units[u] for u in units}
        return {"segment": self.name, "bytes": self.bytes, "units": listed}


def segment_name(number: int) -> str:
    return f"part-{number:06d}.parquet"


def segment_number(name: str) -> int:
    """The number in ``part-000012.parquet``; -1 for another name."""
    digits = name.removeprefix("part-").removesuffix(".parquet")
    return int(digits) if digits.isdigit() else -1


def is_segment(name: str) -> bool:
    """Whether ``name`` is one dask_pcm gives segments (``part-000012.parquet``), not, say,
    Spark's ``part-00000-<uuid>.snappy.parquet``, which :data:`PATTERN` matches too."""
    number = segment_number(name)
    return number >= 0 and segment_name(number) == name


def read_index(root: Path) -> tuple[dict[str, Segment], int]:
    """The segments the index lists (lines of one segment merged, the last size winning),
    and the number of lines read. A line that cannot be parsed (a run killed while
    appending it) is skipped: the segment it described is checked against its footer."""
    segments: dict[str, Segment] = {}
    lines = 0
    try:
        text = (root / INDEX).read_text()
    except FileNotFoundError:
        return segments, 0
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        lines += 1
        try:
            entry = json.loads(line)
            segment = segments.setdefault(entry["segment"], Segment(entry["segment"]))
            segment.units.update({str(k): int(v) for k, v in entry["units"].items()})
            segment.bytes = int(entry["bytes"])
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            logger.warning("%s line %d cannot be read (%s); skipped", root / INDEX, number, exc)
    return segments, lines


def read_footer(path: Path) -> Segment | None:
    """The segment as its own footer describes it; ``None`` when the file is damaged (cannot
    be read, lists no units, or holds another number of rows than its units add up to)."""
    import pyarrow.parquet as pq

    try:
        meta = pq.read_metadata(path)
        units = json.loads((meta.metadata or {})[UNITS_KEY])
        segment = Segment(path.name, {str(k): int(v) for k, v in units.items()})
        segment.bytes = path.stat().st_size
    except Exception as exc:  # pyarrow raises several kinds for damaged files
        logger.debug("footer of %s: %s: %s", path, type(exc).__name__, exc)
        return None
    return segment if segment.units and segment.rows == meta.num_rows else None


def reconcile(root: Path) -> tuple[dict[str, Segment], bool]:
    """The folder's usable segments, from its index checked against one directory listing.

    A listed segment whose size differs from the index, or that the index lacks, is taken
    from its footer; a damaged one is set aside as ``.<name>.unreadable-<time>`` (with a
    warning), and its units count as not done; files of other names are left alone. Returns
    the segments and whether the index must be rewritten to match them.
    """
    indexed, lines = read_index(root)
    present = {p.name: p for p in root.glob(PATTERN) if is_segment(p.name)}
    segments: dict[str, Segment] = {}
    changed = lines != len(indexed)
    for name, path in sorted(present.items()):
        known = indexed.get(name)
        if known is not None and known.bytes == path.stat().st_size:
            segments[name] = known
            continue
        changed = True
        found = read_footer(path)
        if found is not None:
            segments[name] = found
            continue
        aside = path.with_name(f".{name}.unreadable-{time.strftime('%Y%m%dT%H%M%S')}")
        os.replace(path, aside)
        units = len(known.units) if known else "its"
        logger.warning(
            "Output segment %s cannot be used: set aside as %s; %s units are computed again",
            path,
            aside.name,
            units,
        )
    for name in indexed.keys() - present.keys():
        changed = True
        logger.warning(
            "Output segment %s, listed in %s, is missing; its %d units are computed again",
            root / name,
            INDEX,
            len(indexed[name].units),
        )
    return segments, changed


def index_text(segments: Iterable[Segment]) -> str:
    """The whole index for ``segments``, one line each."""
    return "".join(json.dumps(s.entry()) + "\n" for s in segments)


def read_predictions(
    root: str | os.PathLike[str],
    columns: list[str] | None = None,
    *,
    where: tuple[str, Iterable[Any]] | None = None,
) -> pd.DataFrame:
    """The rows of the output folder ``root``, with ``columns`` (default all), in the order
    they were written; ``where=(column, values)`` keeps the rows whose ``column`` is one of
    ``values``."""
    return _read(_dataset(root), where, columns)


def iter_predictions(
    root: str | os.PathLike[str], columns: list[str] | None = None, rows: int = 65536
) -> Iterator[pd.DataFrame]:
    """The rows of :func:`read_predictions`, about ``rows`` at a time (a few segments'
    worth in memory at once, whatever the folder holds)."""
    import pandas as pd

    dataset = _dataset(root)
    if dataset is None:
        return
    present = None if columns is None else [c for c in columns if c in dataset.schema.names]
    for batch in dataset.to_batches(columns=present, batch_size=rows):
        frame = batch.to_pandas()
        if columns is not None:
            for name in columns:
                if name not in frame:
                    frame[name] = None
            frame = frame[columns]
        if len(frame):
            yield pd.DataFrame(frame)


def read_groups(
    root: str | os.PathLike[str],
    column: str,
    values: Iterable[Any],
    columns: list[str] | None = None,
) -> Iterator[tuple[Any, pd.DataFrame]]:
    """(value, its rows) for each of ``values`` of ``column``, one at a time: what
    :func:`read_predictions` reads, one group's rows in memory at once, the segments'
    footers read once."""
    dataset = _dataset(root)
    for value in values:
        yield value, _read(dataset, (column, [value]), columns)


def written_schema(root: str | os.PathLike[str]) -> pa.Schema | None:
    """The columns of the segments written in ``root`` so far, as they are read together
    (their union; numbers widen); ``None`` when there are none."""
    return _schema(_segment_paths(root))


def _segment_paths(root: str | os.PathLike[str]) -> list[Path]:
    if not Path(root).is_dir():
        raise OutputFolderError(f"output folder {root} does not exist (any more)")
    return sorted(p for p in Path(root).glob(PATTERN) if is_segment(p.name))


def _schema(paths: list[Path]) -> pa.Schema | None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not paths:
        return None
    # Segments of one folder may differ in their columns (an ``error`` column appears with
    # the first row recorded as an error; folders written before it have none): read them
    # under their union, a missing column as nulls.
    return pa.unify_schemas(
        [pq.read_schema(p) for p in paths], promote_options="permissive"
    ).remove_metadata()


def _dataset(root: str | os.PathLike[str]) -> Any:
    """The segments of ``root`` as one pyarrow dataset; ``None`` when there are none."""
    import pyarrow.dataset as ds

    paths = _segment_paths(root)
    if not paths:
        return None
    return ds.dataset(paths, format="parquet", schema=_schema(paths))


def _read(
    dataset: Any, where: tuple[str, Iterable[Any]] | None, columns: list[str] | None
) -> pd.DataFrame:
    import pandas as pd
    import pyarrow.dataset as ds

    if dataset is None:
        return pd.DataFrame(columns=columns)
    wanted = None if where is None else ds.field(where[0]).isin(list(where[1]))
    present = None if columns is None else [c for c in columns if c in dataset.schema.names]
    table = dataset.to_table(columns=present, filter=wanted).to_pandas()
    for name in columns or []:
        if name not in table:
            table[name] = None
    return table if columns is None else table[columns]
