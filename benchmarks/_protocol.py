"""The timing protocol of the benchmarks: repetitions in random order, intervals, the stamp.

Every benchmark that compares variants follows it:

- **Repetitions, interleaved.** Each variant runs ``repetitions`` times (3 by default, 1 with
  ``--quick``) in rounds; each round runs every variant once, in an order drawn from a seeded
  random generator (:func:`schedule`). A slow minute on this shared machine then lands on
  different variants in different rounds instead of on whichever always runs last.
- **Two windows.** A variant's row carries ``end_to_end_seconds`` (from the start of its
  cluster, actors or processes, registration and warm-up inside, to its last result) and
  ``steady_seconds`` (from the moment it could start on the work to its last result).
- **Median and a 95 % interval.** :func:`interval` summarises a variant's repetitions: the
  median, and a Student-t interval of the mean on a log scale (timings spread by a factor,
  and an interval of a ratio must not cross 0). With 3 repetitions t is 4.30, so the
  interval is wide: that is the honest width of 3 runs on a machine where one run moves by
  ±20 %.
  :func:`ratio_interval` does the same for the ratio of two variants, paired by round (the
  ratio of each round, then the interval of those ratios): the drift that a round shares
  cancels. A ratio "clears the noise" when its interval excludes 1 (:func:`clears`).
- **The stamp.** :func:`meta` records what a reader needs to trust a figure later: the commit
  (and whether the tree had changes), the date, the CPU model and cores, the load average
  when the script started, the versions of the stack, the repetitions, the command line and
  the claims scored (:func:`record_data`). :func:`write_json` writes ``{"meta": ..., "rows": [...], "summary": ...}``.
"""

from __future__ import annotations

import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_REPETITIONS = 3

# The load average when the benchmark started (this module is imported at its start): the
# machine is shared, and a figure taken under load is worth less.
LOAD_BEFORE = os.getloadavg()
_STARTED = time.time()

# Two-sided 95 % quantiles of Student's t for 1 to 30 degrees of freedom (standard table).
_T95 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def repetitions(quick: bool, asked: int | None = None) -> int:
    """``asked`` if given (at least 1), else 1 with ``--quick`` and 3 otherwise."""
    if asked is not None:
        if asked < 1:
            raise ValueError(f"--repetitions must be 1 or more, got {asked}")
        return asked
    return 1 if quick else DEFAULT_REPETITIONS


def schedule(variants: Sequence[str], rounds: int, seed: int = 0) -> list[tuple[int, str]]:
    """``(round, variant)`` pairs: every variant once per round, each round in its own
    random order drawn from ``seed`` (the same seed gives the same schedule)."""
    if len(set(variants)) != len(variants):
        raise ValueError(f"variant names repeat: {list(variants)}")
    rng = random.Random(seed)
    order: list[tuple[int, str]] = []
    for r in range(rounds):
        names = list(variants)
        rng.shuffle(names)
        order += [(r, name) for name in names]
    return order


def t95(n: int) -> float:
    """The two-sided 95 % Student-t quantile for a mean of ``n`` values (n >= 2)."""
    df = n - 1
    if df < 1:
        raise ValueError("an interval needs at least 2 values")
    return _T95[df - 1] if df <= len(_T95) else 1.96


def interval(values: Sequence[float]) -> dict[str, Any]:
    """``{"runs", "median", "mean", "low", "high"}`` of positive ``values`` (seconds, rates,
    ratios): the 95 % Student-t interval of their mean taken on a log scale, so that it is
    a factor either side (never below 0) and a ratio and its inverse get mirrored intervals;
    ``mean`` is the geometric mean. With one value, low and high are that value (no
    interval: ``runs`` says so)."""
    xs = [float(v) for v in values]
    if not xs:
        raise ValueError("no values to summarise")
    if min(xs) <= 0:
        raise ValueError(f"an interval on a log scale needs positive values, got {xs}")
    logs = [math.log(x) for x in xs]
    centre = statistics.fmean(logs)
    half = t95(len(xs)) * statistics.stdev(logs) / math.sqrt(len(xs)) if len(xs) > 1 else 0.0
    return {
        "runs": len(xs),
        "median": statistics.median(xs),
        "mean": math.exp(centre),
        "low": math.exp(centre - half),
        "high": math.exp(centre + half),
    }


def ratio_interval(numerator: Sequence[float], denominator: Sequence[float]) -> dict[str, Any]:
    """:func:`interval` of ``numerator[r] / denominator[r]``, one ratio per round ``r``."""
    if len(numerator) != len(denominator):
        raise ValueError(f"{len(numerator)} values over {len(denominator)}: pair them by round")
    return interval([a / b for a, b in zip(numerator, denominator, strict=True)])


def clears(summary: dict[str, Any], than: float = 1.0) -> bool | None:
    """Whether the interval lies wholly above or below ``than``; None with one value."""
    if summary["runs"] < 2:
        return None
    return bool(summary["low"] > than or summary["high"] < than)


def by_variant(rows: Sequence[dict[str, Any]], key: str, value: str) -> dict[str, list[float]]:
    """``{row[key]: [row[value] per round, in round order]}`` over rows that carry ``round``."""
    out: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        out.setdefault(str(row[key]), []).append((int(row["round"]), float(row[value])))
    return {k: [v for _, v in sorted(pairs)] for k, pairs in out.items()}


def format_interval(summary: dict[str, Any], spec: str = ".2f") -> str:
    """``"1.38 (1.21-1.55)"`` (an en dash): median and interval; the median alone with one
    value."""
    median = format(summary["median"], spec)
    if summary["runs"] < 2:
        return median
    return f"{median} ({format(summary['low'], spec)}\u2013{format(summary['high'], spec)})"


# -- the stamp -------------------------------------------------------------------------------
def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("dask", "distributed", "dask-jobqueue", "torch", "transformers", "pandas", "ray"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def _checkout() -> tuple[str | None, bool | None]:
    status = _git("status", "--porcelain", "--untracked-files=no")
    return _git("rev-parse", "HEAD"), (bool(status) if status is not None else None)


# The code that runs is the code checked out when the benchmark starts (a commit made while
# it runs must not be stamped on its figures).
_COMMIT, _DIRTY = _checkout()


# The claims a run scored, as :func:`record_data` was told (``_harness.load_claims``): the
# file's name, SHA-256 and how many claims of it, or the built-in demo claims. A run from a
# checkout without the FEVER dev set beside it falls back to the demo claims, whose prompts
# are shorter: its figures are not comparable with a run on the dev set.
_DATA: dict[str, Any] = {}


def record_data(**what: Any) -> None:
    """Say what claims this run scores; :func:`meta` stamps it as ``data``."""
    _DATA.clear()
    _DATA.update(what)


def meta(reps: int, **extra: Any) -> dict[str, Any]:
    """What the figures of one run were measured on and with (see the module's docstring)."""
    return {
        "commit": _COMMIT,
        "dirty": _DIRTY,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(_STARTED)),
        "seconds": round(time.time() - _STARTED, 1),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "load_average_before": [round(x, 2) for x in LOAD_BEFORE],
        "versions": _versions(),
        "repetitions": reps,
        "argv": [Path(sys.argv[0]).name, *sys.argv[1:]],
        **({"data": dict(_DATA)} if _DATA else {}),
        **extra,
    }


def write_json(
    path: Path | None,
    rows: Sequence[dict[str, Any]],
    *,
    reps: int,
    summary: Any = None,
    **extra_meta: Any,
) -> None:
    """Write ``{"meta", "rows", "summary"}`` to ``path`` (nothing without a path)."""
    if path is None:
        return
    doc = {"meta": meta(reps, **extra_meta), "rows": list(rows), "summary": summary}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"results written to {path}")
