"""FEVER claims: read, check and sample them.

FEVER files hold one JSON object per line; only ``id``, ``label`` and ``claim`` are used here.
:func:`load_claims` streams a file line by line, accepts untidy but valid files (a UTF-8 byte
order mark, CRLF line ends, blank lines) and raises :class:`~dask_pcm.exceptions.FeverFormatError`
naming the file and line of anything malformed. :func:`demo_claims` is a small built-in set so
that examples run offline.
"""

from __future__ import annotations

import json
import logging
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from dask_pcm.apps.fever.errors import FeverFormatError

if TYPE_CHECKING:
    import pandas as pd

logger = logging.getLogger(__name__)

LABELS: tuple[str, str, str] = ("SUPPORTS", "REFUTES", "NOT ENOUGH INFO")

#: What :func:`load_claims` may do with a malformed line: stop, or skip it and count it.
ERRORS = ("raise", "skip")

# How many problems the skip-mode warning quotes before it only counts.
_QUOTED_PROBLEMS = 3


@dataclass(frozen=True)
class Claim:
    """One FEVER claim.

    Parameters
    ----------
    id
        The claim's id in its file (FEVER uses integers).
    claim
        The claim's text.
    label
        One of :data:`LABELS`.

    Examples
    --------
    >>> Claim(1, "Paris is the capital of France.", "SUPPORTS").label
    'SUPPORTS'
    """

    id: int | str
    claim: str
    label: str


@dataclass
class ClaimSet:
    """Claims read from one file, in file order.

    Parameters
    ----------
    claims
        The claims.
    path
        The file they came from, as given; ``None`` for the built-in demo set.
    skipped
        How many malformed lines were skipped (``errors="skip"``).
    lines
        The 1-based line of each claim in ``path`` (``None`` for the demo set).

    Examples
    --------
    >>> claims = demo_claims()
    >>> len(claims), claims.label_counts()["REFUTES"]
    (30, 10)
    """

    claims: list[Claim]
    path: str | None = None
    skipped: int = 0
    lines: list[int] | None = None

    def __len__(self) -> int:
        return len(self.claims)

    def __iter__(self) -> Iterator[Claim]:
        return iter(self.claims)

    def where(self, index: int) -> str:
        """Where claim ``index`` comes from, for messages: ``"<path>:<line>: claim <id>"``,
        or ``"claim <id>"`` without a file.

        Examples
        --------
        >>> demo_claims().where(2)
        'claim 3'
        """
        if not 0 <= index < len(self.claims):
            return "claim (unknown)"
        claim = f"claim {self.claims[index].id}"
        if self.path is None or self.lines is None:
            return claim
        return f"{self.path}:{self.lines[index]}: {claim}"

    def label_counts(self) -> dict[str, int]:
        """The number of claims per label, for every label in :data:`LABELS` order."""
        counts = dict.fromkeys(LABELS, 0)
        for claim in self.claims:
            counts[claim.label] += 1
        return counts

    def to_frame(self) -> pd.DataFrame:
        """The claims as a DataFrame with columns ``id``, ``claim`` and ``label``."""
        import pandas as pd

        return pd.DataFrame(
            {
                "id": [c.id for c in self.claims],
                "claim": [c.claim for c in self.claims],
                "label": [c.label for c in self.claims],
            },
            columns=["id", "claim", "label"],
        )


def load_claims(
    path: str | os.PathLike[str],
    *,
    errors: Literal["raise", "skip"] = "raise",
    limit: int | None = None,
    seed: int = 0,
) -> ClaimSet:
    """Read FEVER claims from a JSON-lines file.

    Parameters
    ----------
    path
        A FEVER file such as ``paper_dev.jsonl``: one JSON object per line with at least
        ``id``, ``label`` and ``claim``; other fields are ignored.
    errors
        ``"raise"`` (default) raises on the first malformed line; ``"skip"`` skips malformed
        lines, counts them in :attr:`ClaimSet.skipped` and logs one warning.
    limit
        Keep only this many claims, sampled at random but stratified by label (each label
        keeps its share of the file); the sample keeps file order.
    seed
        Seed of the sample; the same seed gives the same sample.

    Returns
    -------
    ClaimSet

    Raises
    ------
    FeverFormatError
        The file is missing, has no claims, or (with ``errors="raise"``) a line is malformed;
        the message starts with ``"<path>:<line>: "``.
    ValueError
        ``errors`` or ``limit`` is invalid.

    Examples
    --------
    >>> claims = load_claims("paper_dev.jsonl", limit=300)  # doctest: +SKIP
    >>> claims.label_counts()  # doctest: +SKIP
    {'SUPPORTS': 100, 'REFUTES': 100, 'NOT ENOUGH INFO': 100}
    """
    if errors not in ERRORS:
        raise ValueError(f"errors must be 'raise' or 'skip', not {errors!r}")
    if limit is not None and limit <= 0:
        raise ValueError(f"limit must be a positive number of claims, not {limit!r}")
    name = str(path)
    claims: list[Claim] = []
    lines: list[int] = []
    problems: list[str] = []
    first_line_of: dict[int | str, int] = {}
    try:
        # Binary lines decoded one by one, so that bad UTF-8 is reported with its line number.
        with open(path, "rb") as f:
            for number, raw in enumerate(f, start=1):
                try:
                    claim = _parse_line(raw, number, first_line_of)
                except _LineError as e:
                    message = f"{name}:{number}: {e}"
                    if errors == "raise":
                        raise FeverFormatError(message) from None
                    problems.append(message)
                    continue
                if claim is not None:
                    first_line_of[claim.id] = number
                    claims.append(claim)
                    lines.append(number)
    except OSError as e:
        raise FeverFormatError(f"{name}: cannot read FEVER claims: {e.strerror or e}") from e
    if problems:
        quoted = "; ".join(problems[:_QUOTED_PROBLEMS])
        more = len(problems) - _QUOTED_PROBLEMS
        logger.warning(
            "Skipped %d malformed line(s) in %s: %s%s",
            len(problems),
            name,
            quoted,
            f" (and {more} more)" if more > 0 else "",
        )
    if not claims:
        if problems:
            raise FeverFormatError(
                f"{name}: no claims left after skipping {len(problems)} malformed line(s); "
                f"first: {problems[0]}"
            )
        raise FeverFormatError(f"{name}: no claims (the file is empty or has only blank lines)")
    result = ClaimSet(claims, name, len(problems), lines)
    if limit is not None:
        result = sample_claims(result, limit, seed=seed)
    return result


def sample_claims(claims: ClaimSet, limit: int, *, seed: int = 0) -> ClaimSet:
    """``limit`` of ``claims``, stratified by label, in their original order.

    Each label gets its share of ``limit`` in proportion to its count; the claims left over
    by rounding go to the labels with the largest remainders (ties in :data:`LABELS` order).
    Every label present keeps at least one claim when ``limit`` allows it.

    Examples
    --------
    >>> sample_claims(demo_claims(), 6, seed=1).label_counts()
    {'SUPPORTS': 2, 'REFUTES': 2, 'NOT ENOUGH INFO': 2}
    """
    if limit <= 0:
        raise ValueError(f"limit must be a positive number of claims, not {limit!r}")
    if limit >= len(claims):
        return ClaimSet(list(claims.claims), claims.path, claims.skipped, claims.lines)
    by_label: dict[str, list[int]] = {label: [] for label in LABELS}
    for index, claim in enumerate(claims.claims):
        by_label[claim.label].append(index)
    quotas = _allocate(limit, {label: len(idx) for label, idx in by_label.items()})
    rng = random.Random(seed)
    chosen: list[int] = []
    for label in LABELS:
        chosen.extend(rng.sample(by_label[label], quotas[label]))
    kept = sorted(chosen)
    lines = None if claims.lines is None else [claims.lines[i] for i in kept]
    return ClaimSet([claims.claims[i] for i in kept], claims.path, claims.skipped, lines)


def _allocate(limit: int, counts: dict[str, int]) -> dict[str, int]:
    """Split ``limit`` over labels in proportion to ``counts`` (largest remainder method)."""
    total = sum(counts.values())
    exact = {label: limit * n / total for label, n in counts.items()}
    quotas = {label: int(share) for label, share in exact.items()}
    order = sorted(counts, key=lambda label: (-(exact[label] - quotas[label]), LABELS.index(label)))
    for label in order[: limit - sum(quotas.values())]:
        quotas[label] += 1
    present = [label for label in LABELS if counts[label]]
    if limit >= len(present):
        # A rare label can round to zero; give it one claim from the largest quota.
        for label in present:
            if quotas[label] == 0:
                donor = max(present, key=lambda other: (quotas[other], -LABELS.index(other)))
                quotas[donor] -= 1
                quotas[label] = 1
    return quotas


class _LineError(Exception):
    """What is wrong with one line; load_claims adds the file and line number."""


def _parse_line(raw: bytes, number: int, first_line_of: dict[int | str, int]) -> Claim | None:
    """The claim on one line, ``None`` for a blank line; raises :class:`_LineError`."""
    try:
        text = raw.decode("utf-8-sig" if number == 1 else "utf-8")
    except UnicodeDecodeError as e:
        raise _LineError(f"not valid UTF-8 ({e.reason} at byte {e.start})") from None
    if not text.strip():
        return None
    try:
        record: Any = json.loads(text)
    except json.JSONDecodeError as e:
        raise _LineError(f"invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(record, dict):
        raise _LineError(f"expected a JSON object, got {type(record).__name__}")
    missing = [key for key in ("id", "label", "claim") if key not in record]
    if missing:
        raise _LineError(f"missing field(s) {', '.join(map(repr, missing))}")
    id_, label, claim = record["id"], record["label"], record["claim"]
    if isinstance(id_, bool) or not isinstance(id_, int | str):
        raise _LineError(f"id must be an integer or a string, not {id_!r}")
    if label not in LABELS:
        allowed = ", ".join(map(repr, LABELS))
        raise _LineError(f"unknown label {label!r}; expected one of {allowed}")
    if not isinstance(claim, str):
        raise _LineError(f"claim must be a string, not {type(claim).__name__}")
    for key, value in (("claim", claim), ("id", id_)):
        if isinstance(value, str):
            problem = unicode_problem(value)
            if problem:
                raise _LineError(f"{key} is {problem}")
    if not claim.strip():
        raise _LineError("empty claim")
    if id_ in first_line_of:
        raise _LineError(f"duplicate id {id_!r} (first seen on line {first_line_of[id_]})")
    return Claim(id_, claim.strip(), label)


def unicode_problem(text: str) -> str | None:
    """Why ``text`` is not valid Unicode, or ``None``: a lone surrogate (a JSON ``\\ud800``
    escape) parses, but the tokenizer and the Parquet writer cannot encode it, and would fail
    late with no file or line.

    Example
    -------
    >>> print(unicode_problem("ab\\ud800"))
    not valid Unicode (lone surrogate \\ud800 at character 3)
    >>> unicode_problem("ok") is None
    True
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"not valid Unicode (lone surrogate \\u{ord(text[e.start]):04x} at character {e.start + 1})"
    return None


# Invented for dask_pcm: plain facts, plain falsehoods and unverifiable anecdotes.
_DEMO: tuple[tuple[str, str], ...] = (
    ("SUPPORTS", "Water boils at 100 degrees Celsius at sea level."),
    ("REFUTES", "The Sun orbits the Earth once a year."),
    ("NOT ENOUGH INFO", "A baker in a small Welsh village once made a loaf shaped like a harp."),
    ("SUPPORTS", "The Pacific is the largest ocean on Earth."),
    ("REFUTES", "Iceland lies in the Southern Hemisphere."),
    ("NOT ENOUGH INFO", "The lighthouse keeper's cat preferred the north window."),
    ("SUPPORTS", "Mount Everest is in the Himalayas."),
    ("REFUTES", "Whales are a kind of fish."),
    ("NOT ENOUGH INFO", "Marta Lindqvist owns a blue bicycle."),
    ("SUPPORTS", "Paris is the capital of France."),
    ("REFUTES", "Lisbon is the capital of Spain."),
    ("NOT ENOUGH INFO", "The village chess club met twice during a rainy March."),
    ("SUPPORTS", "A week has seven days."),
    ("REFUTES", "A triangle has four sides."),
    ("NOT ENOUGH INFO", "An unnamed violinist practised scales every morning on a ferry."),
    ("SUPPORTS", "The Moon orbits the Earth."),
    ("REFUTES", "Gold is lighter than water."),
    ("NOT ENOUGH INFO", "The author's grandmother kept a diary written in green ink."),
    ("SUPPORTS", "Spiders have eight legs."),
    ("REFUTES", "The Sahara is covered by a permanent ice sheet."),
    ("NOT ENOUGH INFO", "A gardener in Ohio grew a pumpkin that won a ribbon last autumn."),
    ("SUPPORTS", "Tokyo is a city in Japan."),
    ("REFUTES", "Bats are unable to fly."),
    ("NOT ENOUGH INFO", "Tomas Ferreira learned to juggle at the age of nine."),
    ("SUPPORTS", "Penguins are birds."),
    ("REFUTES", "Mars has no moons."),
    ("NOT ENOUGH INFO", "The old museum's caretaker whistled while locking the doors."),
    ("SUPPORTS", "The Amazon River flows through Brazil."),
    ("REFUTES", "The Nile flows into the Baltic Sea."),
    ("NOT ENOUGH INFO", "A student named Priya wrote her thesis in a train station café."),
)


def demo_claims() -> ClaimSet:
    """A built-in set of 30 invented claims, 10 per label, with ids 1 to 30.

    Examples
    --------
    >>> demo_claims().claims[0]
    Claim(id=1, claim='Water boils at 100 degrees Celsius at sea level.', label='SUPPORTS')
    """
    claims = [Claim(i, text, label) for i, (label, text) in enumerate(_DEMO, start=1)]
    return ClaimSet(claims, None, 0)


def write_demo(path: str | os.PathLike[str]) -> Path:
    """Write :func:`demo_claims` to ``path`` as FEVER JSON lines and return the path.

    Examples
    --------
    >>> load_claims(write_demo(tmp_path / "demo.jsonl")).label_counts()  # doctest: +SKIP
    {'SUPPORTS': 10, 'REFUTES': 10, 'NOT ENOUGH INFO': 10}
    """
    path = Path(path)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for claim in demo_claims():
            verifiable = "NOT VERIFIABLE" if claim.label == "NOT ENOUGH INFO" else "VERIFIABLE"
            record: dict[str, Any] = {
                "id": claim.id,
                "verifiable": verifiable,
                "label": claim.label,
                "claim": claim.claim,
                "evidence": [],
            }
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path
