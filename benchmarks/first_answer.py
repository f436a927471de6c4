"""First answer: the timeline of a fresh ``dask-pcm batch`` on 96 chat requests (issue 41).

Each repetition runs, in a new process, ``dask-pcm batch -i FILE -o DIR --workers 2`` on a
file of 96 chat completion requests (``max_tokens`` 16, temperature 0, each user message its
own), the embedded SmolLM2-135M-Instruct answering; and, interleaved with it in a random
order per round (:mod:`_protocol`), ``dask-pcm fever --workers 2`` (the demo claims under
every built-in template) for comparison. dask_pcm's INFO log is on and the local cluster's
workers are not silenced, so every process of the run logs to the command's standard error;
each line is stamped with the seconds from the command's start to its first byte
(:class:`_harness.Lines`). ``pcm.batch.flush-interval`` is 0 for the batch runs, so that
the output folder shows each finished unit as it comes (a segment of 96 rows rewritten per
unit: milliseconds); the folder is watched every 20 ms. Caches are warm: one run of each,
not timed, first.

What each figure is (seconds from the command's start):

- ``cluster_at``: the dashboard link is printed (the cluster is up; workers may still be
  importing);
- ``registered_at``: the client has declared the context (``Registered context``);
- ``imported_at``: the last worker's preimport thread is done (``pcm.worker.preimport-modules``);
- ``copy_seconds``, ``from_pretrained_seconds``, ``warm_up_seconds`` (durations, the slower
  worker): the template's copy to local disk (the one that made it, or waited for it), the
  model's build and its warm-up pass;
- ``first_ready_at``, ``last_ready_at``: the first and the last worker with the model ready;
- ``first_unit_at``: the progress bar counts the first unit back (the first answer, in the
  client's hands);
- ``first_segment_at``: the output folder's first segment is in place (batch only);
- ``first_unit_after_ready`` (a duration): from the first worker ready to the first unit
  back: its tasks' dispatch and the first unit's work, what start-up does not explain;
- ``last_unit_at``: the bar counts every unit;
- ``seconds``: the whole command, until its process exits.

When a unit starts on its worker is not in the command's output; run a run in-process with
``distributed.get_task_stream`` for that.

``--quick`` runs one repetition of 32 requests and a smaller FEVER grid; ``--model`` goes to
both commands (``tiny`` for a smoke run).

Examples::

    python benchmarks/first_answer.py --json benchmarks/first-answer-<date>.json
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import _harness as h
import _protocol

VARIANTS = ("batch", "fever")
COLUMNS = [
    ("round", "round", "d"),
    ("variant", "variant", "s"),
    ("cluster_at", "cluster", ".1f"),
    ("registered_at", "registered", ".1f"),
    ("imported_at", "imported", ".1f"),
    ("copy_seconds", "copy", ".1f"),
    ("from_pretrained_seconds", "build", ".1f"),
    ("warm_up_seconds", "warm-up", ".2f"),
    ("first_ready_at", "1st ready", ".1f"),
    ("last_ready_at", "last ready", ".1f"),
    ("first_unit_at", "1st unit", ".1f"),
    ("first_segment_at", "1st segment", ".1f"),
    ("first_unit_after_ready", "after ready", ".1f"),
    ("last_unit_at", "last unit", ".1f"),
    ("seconds", "whole run", ".1f"),
]
FIGURES = [name for name, _, _ in COLUMNS if name not in ("round", "variant")]

PATTERNS = {
    "cluster": re.compile(r"^Dask dashboard:"),
    "registered": re.compile(r"Registered context|Context '[^']+' already registered"),
    "imported": re.compile(r"Imported \S+ in [0-9.]+ s"),
    "copy": re.compile(r"Template of .* local copy .* ready in ([0-9.]+) s"),
    "loader": re.compile(
        r"Loaded .*: imports [0-9.]+ s, from_pretrained ([0-9.]+) s, "
        r"warm-up ([0-9.]+) s"
    ),
    "ready": re.compile(r"Context '[^']+' ready on"),
    "units": re.compile(r"units:[^\r\n]*?(\d+)/(\d+)"),
}

# Subjects and requests, crossed: 96 different user messages.
_SUBJECTS = ("Paris", "the Moon", "photosynthesis", "the Roman Empire", "volcanoes", "jazz",
             "prime numbers", "the ocean", "honeybees", "glaciers", "the printing press", "chess")  # fmt: skip
_ASKS = ("Tell me one fact about {}.", "Describe {} in one sentence.", "Why is {} interesting?",
         "What should a child know about {}?", "Give a short summary of {}.",
         "Name something surprising about {}.", "How would you explain {} to a friend?",
         "What is the history of {}?")  # fmt: skip

# The CLI, with its local cluster's workers not silenced (LocalCluster's silence_logs lowers
# every handler of a worker process to WARNING, dask_pcm's too): their INFO lines time it.
_CLI = (
    "import functools, sys; import dask_pcm.deploy.local as local; "
    "local.LocalCluster = functools.partial(local.LocalCluster, silence_logs=False); "
    "from dask_pcm.cli import main; sys.argv[0] = 'dask-pcm'; main()"
)


def write_requests(path: Path, n: int) -> None:
    """``n`` chat completion requests, each its own user message, 16 greedy tokens."""
    with path.open("w") as f:
        for i in range(n):
            subject = _SUBJECTS[(i // len(_ASKS)) % len(_SUBJECTS)]
            message = _ASKS[i % len(_ASKS)].format(subject)
            if i >= len(_ASKS) * len(_SUBJECTS):
                message += f" ({i})"
            body = {"model": "smollm2", "max_tokens": 16, "temperature": 0,
                    "messages": [{"role": "user", "content": message}]}  # fmt: skip
            line = {"custom_id": f"request-{i:03d}", "method": "POST",
                    "url": "/v1/chat/completions", "body": body}  # fmt: skip
            f.write(json.dumps(line) + "\n")


def command(
    variant: str, quick: bool, workers: int, folder: Path, model: str | None = None
) -> list[str]:
    base = [sys.executable, "-c", _CLI]
    chosen = ["--model", model] if model else []
    if variant == "batch":
        # The requests name "smollm2": answered by whichever model the run serves.
        return [*base, "batch", "-i", str(folder / "requests.jsonl"), "-o",
                str(folder / "answers"), "--workers", str(workers), "--any-model",
                *chosen]  # fmt: skip
    grid = ["--limit", "10", "--num-templates", "2"] if quick else []
    return [*base, "fever", "--workers", str(workers), *grid, *chosen,
            "--json", str(folder / "fever.json")]  # fmt: skip


class FolderWatch:
    """The seconds from ``start`` until a segment (``part-*.parquet``) is in ``folder``."""

    def __init__(self, folder: Path, start: float) -> None:
        self.folder, self.start = folder, start
        self.first: float = float("nan")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.02):
            if self.folder.is_dir() and any(self.folder.glob("part-*.parquet")):
                self.first = time.perf_counter() - self.start
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def timeline(lines: list[tuple[float, str]]) -> dict[str, float]:
    """The figures of one run (see the module docstring) from its stamped lines."""
    nan = float("nan")
    out = dict.fromkeys(FIGURES, nan)
    ready, units, imported, copies, loads = [], [], [], [], []
    for at, line in lines:
        if PATTERNS["imported"].search(line):
            imported.append(at)
        if m := PATTERNS["copy"].search(line):
            copies.append(float(m[1]))
        if m := PATTERNS["loader"].search(line):
            loads.append((float(m[1]), float(m[2])))
        if PATTERNS["cluster"].search(line) and out["cluster_at"] != out["cluster_at"]:
            out["cluster_at"] = at
        if PATTERNS["registered"].search(line) and out["registered_at"] != out["registered_at"]:
            out["registered_at"] = at
        if PATTERNS["ready"].search(line):
            ready.append(at)
        if (m := PATTERNS["units"].search(line)) and int(m[1]) > 0:
            units.append((at, int(m[1]), int(m[2])))
    if imported:
        out["imported_at"] = max(imported)
    if copies:
        out["copy_seconds"] = max(copies)
    if loads:
        out["from_pretrained_seconds"] = max(x for x, _ in loads)
        out["warm_up_seconds"] = max(y for _, y in loads)
    if ready:
        out["first_ready_at"], out["last_ready_at"] = min(ready), max(ready)
    if units:
        out["first_unit_at"] = units[0][0]
        done = [at for at, n, total in units if n == total]
        out["last_unit_at"] = done[0] if done else nan
    return out


def run_once(
    variant: str, quick: bool, workers: int, folder: Path, model: str | None = None
) -> dict[str, Any]:
    """One fresh command, timed (``model``: the CLI's ``--model``; default the embedded
    one); raises with its last lines if it fails."""
    answers = folder / "answers"
    if answers.exists():
        subprocess.run(["rm", "-rf", str(answers)], check=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "DASK_LOGGING__DASK_PCM": "info",
           "HF_HUB_DISABLE_PROGRESS_BARS": "1", "DASK_PCM__BATCH__FLUSH_INTERVAL": "0"}  # fmt: skip
    start = time.perf_counter()
    watch = FolderWatch(answers, start)
    try:
        lines, seconds = h.stamped_run(command(variant, quick, workers, folder, model), env,
                                       folder, start)  # fmt: skip
    finally:
        watch.stop()
    if variant == "batch":
        failed = (answers / "errors.jsonl").read_text().count("\n")
        if failed:
            raise RuntimeError(f"dask-pcm batch answered with {failed} errors: see {answers}")
    row = {**timeline(lines), "first_segment_at": watch.first, "seconds": seconds}
    row["first_unit_after_ready"] = row["first_unit_at"] - row["first_ready_at"]
    return {**row, "load_average": os.getloadavg()[0]}


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per variant, median and interval (and min and max) of each figure logged in every
    run; a figure that was 0 in some run gets its median, min and max only."""
    out = []
    for variant in VARIANTS:
        mine = [r for r in rows if r["variant"] == variant]
        for name in FIGURES:
            values = [r[name] for r in mine]
            if not values or any(v != v for v in values):  # NaN: not logged
                continue
            row = {"variant": variant, "figure": name, "min": min(values), "max": max(values)}
            if min(values) > 0:
                row.update(_protocol.interval(values))
            else:  # a step that took no time in some run (no copy to make): no log interval
                row.update(runs=len(values), median=statistics.median(values))
            out.append(row)
    return out


def main() -> None:
    p = h.parser(__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=None, help="requests in the file (96)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="batch,fever (both)")
    args = p.parse_args()
    reps = _protocol.repetitions(args.quick, args.repetitions)
    n = args.requests or (32 if args.quick else 96)
    variants = [v for v in args.variants.split(",") if v]
    if unknown := sorted(set(variants) - set(VARIANTS)):
        p.error(f"unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)}")
    model = h.model_path(args) if args.model else None
    rows = []
    with tempfile.TemporaryDirectory(prefix="dask-pcm-first-answer-") as tmp:
        folder = Path(tmp)
        write_requests(folder / "requests.jsonl", n)
        print("warming the caches (one run of each, not timed)...", flush=True)
        for variant in variants:
            run_once(variant, True, args.workers, folder, model)
        for r, variant in _protocol.schedule(variants, reps, args.seed):
            timed = run_once(variant, args.quick, args.workers, folder, model)
            row = {"round": r, "variant": variant, **timed}
            rows.append(row)
            print(f"round {r} {variant}: first unit at {row['first_unit_at']:.1f} s, whole run "
                  f"{row['seconds']:.1f} s (load {row['load_average']:.1f})", flush=True)  # fmt: skip
    print()
    h.print_table(rows, COLUMNS)
    result = summary(rows)
    print(json.dumps(result, indent=1))
    h.write_json(args.json, rows, reps=reps, summary={"intervals": result},
                 requests=n, workers=args.workers, model=model or "embedded")  # fmt: skip


if __name__ == "__main__":
    main()
