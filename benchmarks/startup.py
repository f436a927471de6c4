"""Time to first result: the timeline of a fresh ``dask-pcm fever`` on the embedded defaults.

Each repetition runs ``dask-pcm fever --workers 2`` (``--workers``; README command 1: the
demo claims under every built-in template, the embedded SmolLM2-135M-Instruct) in a new
process, with dask_pcm's INFO log on (``DASK_LOGGING__DASK_PCM=info``, and the local
cluster's workers not silenced: every process of the run logs to the command's standard
error), and stamps each line of that standard error with the seconds since the command
started. Caches are warm: one run first, not timed, converts the embedded model and hashes
its manifest if this machine has not.

What each figure is (seconds; ``*_at`` from the command's start, the others durations):

- ``cluster_at``: the dashboard link is printed (cluster started, workers may still start);
- ``manifest_seconds``: the client lists and hashes the template (``Manifest of ...``;
  from its cache when warm);
- ``host_copy_seconds``: the client's copy of the template into the host's template
  folder, made while the cluster starts (``Host copy ... in``);
- ``imports_seconds``: a worker's ``import torch`` and ``import transformers`` (the slower
  worker; from the preimport thread's lines, or from the loader's own ``imports`` figure);
- ``copy_seconds``: a worker's template copy, from asking for it to holding a verified one
  (the slower worker: the one that made the copy, or waited for it; about 0 when the
  client's copy was ready);
- ``from_pretrained_seconds``, ``warm_up_seconds``: a worker's model build and warm-up
  pass (the slower worker);
- ``first_ready_at``, ``last_ready_at``: the first and the last worker with the model ready;
- ``first_unit_at``, ``last_unit_at``: the progress bar counts the first unit back, and all;
- ``seconds``: the whole command, until its process exits.

Each round also times the *floor* (``floor_seconds``): a fresh Python process that imports
torch and transformers, loads the same model (``AutoTokenizer`` and
``AutoModelForCausalLM.from_pretrained`` from the converted embedded model, float32) and
runs one forward pass, from its start to its exit: what any first result costs on this
host, whatever runs it. The command and the floor run back to back in each round, in an
order drawn from ``--seed`` (``_protocol.schedule``), and the summary gives the ratios
``first_unit_at / floor_seconds`` and ``seconds / floor_seconds`` per round, with their
interval: the machines this project runs on differ by about 2x, a ratio to the floor holds
on both.

``--quick`` runs one repetition of a smaller grid (``--limit 10 --num-templates 2``).

Examples::

    python benchmarks/startup.py --json benchmarks/startup-<date>.json
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import _harness as h
import _protocol

COLUMNS = [
    ("round", "round", "d"),
    ("cluster_at", "cluster", ".1f"),
    ("manifest_seconds", "manifest", ".2f"),
    ("host_copy_seconds", "host copy", ".1f"),
    ("imports_seconds", "imports", ".1f"),
    ("copy_seconds", "copy", ".1f"),
    ("from_pretrained_seconds", "build", ".1f"),
    ("warm_up_seconds", "warm-up", ".2f"),
    ("first_ready_at", "1st ready", ".1f"),
    ("last_ready_at", "last ready", ".1f"),
    ("first_unit_at", "1st unit", ".1f"),
    ("last_unit_at", "last unit", ".1f"),
    ("seconds", "whole run", ".1f"),
    ("floor_seconds", "floor", ".1f"),
]
FIGURES = [name for name, _, _ in COLUMNS if name != "round"]

_NUMBER = r"([0-9]+\.[0-9]+) s"
PATTERNS = {
    "cluster": re.compile(r"^Dask dashboard:"),
    "manifest": re.compile(r"Manifest of .* (?:cached|hashed): " + _NUMBER),
    "import": re.compile(r"Imported (torch|transformers) in " + _NUMBER),
    "loader": re.compile(
        r"Loaded .*: imports " + _NUMBER + r", from_pretrained " + _NUMBER + ", warm-up " + _NUMBER
    ),
    "copy": re.compile(r"Template of .* local copy .* ready in " + _NUMBER),
    "host_copy": re.compile(r"Host copy .* by this process in " + _NUMBER),
    "ready": re.compile(r"Context '[^']+' ready on"),
    "units": re.compile(r"units:[^\r\n]*?(\d+)/(\d+)"),
}


def timeline(lines: list[tuple[float, str]]) -> dict[str, float]:
    """The figures of one run (see the module docstring) from its stamped lines."""
    nan = float("nan")
    found: dict[str, Any] = {"imports": {}, "loader": [], "copy": [], "ready": [], "units": []}
    out = dict.fromkeys((name for name in FIGURES if name != "floor_seconds"), nan)
    for at, line in lines:
        if PATTERNS["cluster"].search(line) and out["cluster_at"] != out["cluster_at"]:
            out["cluster_at"] = at
        if m := PATTERNS["manifest"].search(line):
            out["manifest_seconds"] = float(m[1])
        if m := PATTERNS["host_copy"].search(line):
            out["host_copy_seconds"] = float(m[1])
        if m := PATTERNS["import"].search(line):
            found["imports"].setdefault(m[1], []).append(float(m[2]))
        if m := PATTERNS["loader"].search(line):
            found["loader"].append(tuple(float(x) for x in m.groups()))
        if m := PATTERNS["copy"].search(line):
            found["copy"].append(float(m[1]))
        if PATTERNS["ready"].search(line):
            found["ready"].append(at)
        if (m := PATTERNS["units"].search(line)) and int(m[1]) > 0:
            found["units"].append((at, int(m[1]), int(m[2])))
    preimported = found["imports"]
    if preimported:  # per worker: torch then transformers, on one thread
        pairs = zip(preimported.get("torch", []), preimported.get("transformers", []), strict=False)
        out["imports_seconds"] = max(a + b for a, b in pairs)
    elif found["loader"]:
        out["imports_seconds"] = max(x[0] for x in found["loader"])
    if found["loader"]:
        out["from_pretrained_seconds"] = max(x[1] for x in found["loader"])
        out["warm_up_seconds"] = max(x[2] for x in found["loader"])
    if found["copy"]:
        out["copy_seconds"] = max(found["copy"])
    if found["ready"]:
        out["first_ready_at"], out["last_ready_at"] = min(found["ready"]), max(found["ready"])
    if found["units"]:
        out["first_unit_at"] = found["units"][0][0]
        done = [at for at, n, total in found["units"] if n == total]
        out["last_unit_at"] = done[0] if done else nan
    return out


# The CLI, with its local cluster's workers not silenced (LocalCluster's silence_logs lowers
# every handler of a worker process to WARNING, dask_pcm's too): their INFO lines time it.
_CLI = (
    "import functools, sys; import dask_pcm.deploy.local as local; "
    "local.LocalCluster = functools.partial(local.LocalCluster, silence_logs=False); "
    "from dask_pcm.cli import main; sys.argv[0] = 'dask-pcm'; main()"
)


def command(quick: bool, workers: int, report: Path) -> list[str]:
    grid = ["--limit", "10", "--num-templates", "2"] if quick else []
    return [sys.executable, "-c", _CLI, "fever", "--workers", str(workers), *grid,
            "--json", str(report)]  # fmt: skip


# The floor: a fresh process that imports torch and transformers, loads the model and runs
# one forward pass (argv[1]: the model's folder).
_FLOOR = (
    "import sys, torch, transformers; "
    "from transformers import AutoModelForCausalLM, AutoTokenizer; "
    "tokenizer = AutoTokenizer.from_pretrained(sys.argv[1]); "
    "model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval(); "
    "batch = tokenizer(['Claim: the floor of a first result is one forward pass. Answer:'], "
    "return_tensors='pt'); "
    "torch.inference_mode()(model)(**batch)"
)


def run_once(quick: bool, workers: int, folder: Path) -> dict[str, Any]:
    """One fresh command, timed; raises with its last lines if it fails."""
    lines, seconds = h.stamped_run(command(quick, workers, folder / "report.json"), _env(), folder)
    return {**timeline(lines), "seconds": seconds, "load_average": os.getloadavg()[0]}


def floor_once(model: Path, folder: Path) -> float:
    """Seconds of one fresh process that imports, loads ``model`` and runs one pass."""
    _, seconds = h.stamped_run([sys.executable, "-c", _FLOOR, str(model)], _env(), folder)
    return seconds


def _env() -> dict[str, str]:
    return {**os.environ, "DASK_LOGGING__DASK_PCM": "info", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def main() -> None:
    args = h.parser(__doc__.split("\n\n")[0]).parse_args()
    reps = _protocol.repetitions(args.quick, args.repetitions)
    rows = []
    with tempfile.TemporaryDirectory(prefix="dask-pcm-startup-") as tmp:
        folder = Path(tmp)
        print("warming the caches (one run, not timed)...", flush=True)
        run_once(True, args.workers, folder)
        from dask_pcm.templates.embedded import embedded_model_dir

        model = embedded_model_dir()
        floor_once(model, folder)
        rounds: dict[int, dict[str, Any]] = {}
        for r, variant in _protocol.schedule(["command", "floor"], reps, args.seed):
            row = rounds.setdefault(r, {"round": r})
            if variant == "floor":
                row["floor_seconds"] = floor_once(model, folder)
                continue
            row.update(run_once(args.quick, args.workers, folder))
        for r, row in sorted(rounds.items()):
            rows.append(row)
            print(f"round {r}: first unit at {row['first_unit_at']:.1f} s, whole run "
                  f"{row['seconds']:.1f} s, floor {row['floor_seconds']:.1f} s "
                  f"(load {row['load_average']:.1f})", flush=True)  # fmt: skip
    print()
    h.print_table(rows, COLUMNS)
    intervals = summary(rows)
    for entry in intervals:
        if entry["figure"].endswith("_over_floor"):
            print(f"{entry['figure'].replace('_', ' ')}: {_protocol.format_interval(entry)}")
    h.write_json(args.json, rows, reps=reps, seed=args.seed, summary={"intervals": intervals})


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median and interval of each figure logged in every run (a cached manifest's 0.00 s
    counted as 1 ms: the interval is on a log scale), then the first unit and the whole
    command over the floor of the same round."""
    out = [
        {"figure": name, **_protocol.interval([max(r[name], 1e-3) for r in rows])}
        for name in FIGURES
        if all(r[name] == r[name] for r in rows)  # NaN: not logged
    ]
    floors = [r["floor_seconds"] for r in rows]
    for name in ("first_unit_at", "seconds"):
        if all(r[name] == r[name] for r in rows):
            ratio = _protocol.ratio_interval([r[name] for r in rows], floors)
            out.append({"figure": f"{name}_over_floor", **ratio})
    return out


if __name__ == "__main__":
    main()
