"""Paper scale: run_fever over 145,449 claims x 10 templates: files, client memory, throughput
against plain processes, and what a kill costs.

The paper's run scores FEVER's training set (145,449 claims) under the 10 built-in templates:
90,910 units of 16 claims. This script runs that grid through ``dask_pcm.run_fever`` and
measures what the system around the model costs at that size. The model is the tiny random
Llama (``--model tiny``, the default here): its forward passes take milliseconds, so what is
measured is the system's overheads (scheduling, result transfer, writing the output), not the
model. ``--model PATH`` runs another.

Steps, in one process:

1. **Claims.** N claims (``--claims``, default 145,449; ``--quick`` 320) written as FEVER JSON
   lines to a temporary folder, cycling through the dev set (``--data``, default
   ``../shared/data/fever/paper_dev.jsonl``, else the built-in demo claims); ids 0..N-1 are
   unique, claim texts repeat.
2. **In-process reference, before.** The same units (``make_units`` here,
   as run_fever makes them) scored by ``--workers`` plain spawned processes with the workers'
   environment, each loading the model once (``dask_pcm.CausalLM``, one torch thread) and
   scoring its round-robin share as ``score_unit`` does (template rendered with the
   tokenizer, template head kept as prefix, ``score_logits``), without Dask. Timed from all
   loaded to all done. At full size a fixed sample of about 5,000 units (every k-th unit; all
   of them under ``--quick``), the rate per unit carried over.
3. **The run.** ``run_fever(data, model, output=<temporary folder>, workers, progress=False)``,
   the cluster started and closed by run_fever (2 workers x 1 thread by default). Recorded:
   ``seconds`` (the call, cluster start, model loads, shutdown and summary included),
   ``units_per_s`` (units over ``seconds``), and ``steady_units_per_s``: the rate while the
   pipeline is full. A thread polls the output's index (``_dask_pcm_index.jsonl``) every
   0.2 s and notes when each segment's line appears; a segment is written and indexed as
   the unit that fills it arrives, so the lines time the units the client received. Steady
   rate = units between the first line and the last line but one, over the seconds between
   them: no cluster start, model load or first tasks (before the first line), no tail and
   shutdown (the last line is written when the run closes its output). The same thread
   samples the resident memory of this process every 0.2 s (``peak_client_rss_mb``): it is
   the client, and it also hosts the local cluster's scheduler and nannies (the workers are
   other processes); ``ru_maxrss`` (peak of this process over its life) as a cross-check.
   Then ``pandas.read_parquet(output)`` must hold one row per (template, claim), each once.
4. **In-process reference, after**, in the same processes (kept loaded and idle during the
   run). This machine's timings move by +-20 % from one stretch to the next: ``ratio`` is
   the steady rate over the mean of the two references.
5. **Kill and resume.** ``python -m dask_pcm.cli fever`` on the same claims into a second
   folder, in a new session. Once its index lists at least half the units, and its progress
   bar shows half a segment more received than written (a kill mid-segment, not right
   after a write), the whole process group is killed (SIGKILL: CLI, scheduler, nannies,
   workers). ``kill_at_units``: units the client had received, from the CLI's progress bar
   (tqdm, redrawn every 0.1 s on a pipe too: a lower bound by a few units);
   ``persisted_at_kill``: units in the segment files on disk (their footers: what a resume
   recovers). The same command then runs to the end (``--json``): ``resume_computed`` is
   its ``units.computed``; ``recomputed_beyond_unfinished`` = computed - (units - persisted):
   units computed again though they were on disk (should be 0); ``lost_at_kill`` = received
   - persisted: finished units the kill threw away (at most a segment's worth, or what
   ``pcm.batch.flush-interval`` lets accumulate), computed again by the resume;
   ``recompute_pct`` = (computed - (units - received)) / units, the share of the grid
   computed twice. The folder must then hold every row once.

``--quick`` (CI, on 2 cores) writes segments of 512 rows (``pcm.batch.segment-rows``;
default 4,096) so that its small grid has several segments to time and to kill between, and
kills and resumes a one-worker run (each start then loads the model once, not twice).

The issues' goals, printed beside the figures: at most 1,000 files and at most 1 % of the
units computed twice after a kill (issue 27); a client peak RSS of at most 600 MB and
``ratio`` at least 0.9 (issue 32; 2 GB and 0.7 before).

Examples::

    python benchmarks/paper_scale.py --quick
    python benchmarks/paper_scale.py --json /tmp/paper_scale.json   # about 45 min here
    python benchmarks/paper_scale.py --claims 20000 --model /path/to/model
"""

from __future__ import annotations

import contextlib
import json
import math
import multiprocessing
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any

import _harness as h
import _protocol as P
import dask.config
import psutil

import dask_pcm
from dask_pcm.apps.fever import Claim, ClaimSet, demo_claims, load_claims
from dask_pcm.apps.fever.prompts import PromptTemplate, get_templates
from dask_pcm.apps.fever.scoring import score_logits
from dask_pcm.apps.fever.units import template_head
from dask_pcm.batch.segments import INDEX, PATTERN, UNITS_KEY

PAPER_CLAIMS = 145_449  # FEVER 1.0 train
QUICK_CLAIMS = 320
QUICK_SEGMENT_ROWS = 512
CLAIMS_PER_TASK = 16
SAMPLE_UNITS = 5_000  # units the reference scores at most, per round
POLL = 0.2  # seconds between samples of memory and of the index
KILL_POLL = 0.05

COLUMNS = [
    ("figure", "figure", "s"),
    ("value", "value", "s"),
    ("goal", "goal", "s"),
    ("met", "met", "s"),
]


# -- claims ----------------------------------------------------------------------------------
def source_claims(path: Path | None) -> list[Claim]:
    """The claims to cycle through: ``path``, else the dev set if present, else the demo."""
    if path is None and not h.DEFAULT_DATA.is_file():
        P.record_data(source="built-in demo claims")
        return list(demo_claims().claims)
    path = path or h.DEFAULT_DATA
    P.record_data(source=Path(path).name, sha256=h.file_sha256(path))
    return list(load_claims(path).claims)


def write_claims(path: Path, n: int, source: Sequence[Claim]) -> None:
    """``n`` FEVER JSON lines with ids 0..n-1, texts and labels cycled from ``source``."""
    with path.open("w") as f:
        for i in range(n):
            c = source[i % len(source)]
            f.write(json.dumps({"id": i, "label": c.label, "claim": c.claim}) + "\n")


# -- the in-process reference: plain processes, no Dask --------------------------------------
@dataclass(frozen=True)
class Unit:
    """One (template, slice of claims) of the in-process reference."""

    template: PromptTemplate
    index: int
    claims: tuple[Claim, ...]

    @property
    def name(self) -> str:
        return f"{self.template.name}--{self.index:05d}"


def make_units(
    templates: Sequence[PromptTemplate], claims: ClaimSet, claims_per_task: int
) -> list[Unit]:
    """Every (template, batch of ``claims_per_task`` claims), templates first."""
    return [
        Unit(t, i, tuple(claims.claims[start : start + claims_per_task]))
        for t in templates
        for i, start in enumerate(range(0, len(claims), claims_per_task))
    ]


def score_plain(lm: Any, unit: Unit) -> list[dict[str, Any]]:
    """One unit as ``dask_pcm.apps.fever.units.score_unit`` scores it, with ``lm`` in hand."""
    template = unit.template
    prompts = [template.render(c.claim, lm.tokenizer) for c in unit.claims]
    head = template_head(template, lm.tokenizer)
    scored = score_logits(lm, prompts, template.answers, prefix=head)
    return [
        {"claim_id": c.id, "template": template.name, "label": c.label, **row}
        for c, row in zip(unit.claims, scored, strict=True)
    ]


def _reference_process(
    model: str, units: list[Unit], barrier: Any, commands: Any, out: Any
) -> None:
    try:
        import torch

        torch.set_num_threads(1)
        lm = dask_pcm.CausalLM()(model)
        out.put("loaded")
        while commands.get() is not None:
            barrier.wait()
            rows = sum(len(score_plain(lm, unit)) for unit in units)
            out.put(rows)
    except BaseException as exc:
        barrier.abort()
        out.put(f"{type(exc).__name__}: {exc}")


class Reference:
    """``processes`` spawned processes, each holding the model and a round-robin share of
    ``units``; :meth:`round` has them all score their share, started together."""

    def __init__(self, model: str, units: Sequence[Unit], processes: int) -> None:
        self.units = len(units)
        mp = multiprocessing.get_context("spawn")
        self.barrier = mp.Barrier(processes + 1)
        self.out = mp.Queue()
        self.commands = [mp.Queue() for _ in range(processes)]
        self.procs = [
            mp.Process(
                target=_reference_process,
                args=(model, list(units[k::processes]), self.barrier, self.commands[k], self.out),
            )
            for k in range(processes)
        ]

    def __enter__(self) -> Reference:
        with h._worker_environ():
            for p in self.procs:
                p.start()
        self._collect(timeout=600)
        return self

    def __exit__(self, *exc: object) -> None:
        for q in self.commands:
            q.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()

    def _collect(self, timeout: float) -> list[Any]:
        parts = [self.out.get(timeout=timeout) for _ in self.procs]
        errors = [p for p in parts if isinstance(p, str) and p != "loaded"]
        if errors:
            raise RuntimeError(f"a reference process failed: {errors[0]}")
        return parts

    def round(self) -> float:
        """Units per second, from all starting together to all done."""
        for q in self.commands:
            q.put("go")
        self.barrier.wait(timeout=60)
        start = time.perf_counter()
        self._collect(timeout=7200)
        return self.units / (time.perf_counter() - start)


def sample(claims_file: Path, templates: Sequence[Any], quick: bool) -> tuple[int, list[Unit]]:
    """The number of units run_fever makes of ``claims_file``, and every k-th of them,
    about :data:`SAMPLE_UNITS` (all with ``quick``); the others are not kept."""
    units = make_units(templates, load_claims(claims_file), CLAIMS_PER_TASK)
    step = 1 if quick else max(1, math.ceil(len(units) / SAMPLE_UNITS))
    return len(units), list(units[::step])


# -- watching a run --------------------------------------------------------------------------
class IndexReader:
    """Units an output folder's index lists so far, read incrementally (complete lines)."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / INDEX
        self.offset = 0
        self.units = 0

    def poll(self) -> int:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return self.units
        end = data.rfind(b"\n") + 1
        for line in data[:end].splitlines():
            # As dask_pcm's own reader does, a damaged line is skipped.
            with contextlib.suppress(ValueError, KeyError, TypeError):
                self.units += len(json.loads(line)["units"])
        self.offset += end
        return self.units


class Watcher:
    """A thread sampling this process's RSS and the index of ``folder`` every :data:`POLL`
    seconds: ``peak_rss`` (bytes) and ``timeline`` (seconds, units indexed) per change."""

    def __init__(self, folder: Path) -> None:
        self.index = IndexReader(folder)
        self.process = psutil.Process()
        self.peak_rss = 0
        self.timeline: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Watcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _run(self) -> None:
        while not self._stop.wait(POLL):
            self._sample()

    def _sample(self) -> None:
        self.peak_rss = max(self.peak_rss, self.process.memory_info().rss)
        before = self.index.units
        if self.index.poll() != before:
            self.timeline.append((time.perf_counter(), self.index.units))

    def steady_rate(self) -> float:
        """Units per second from the first index line to the last but one (NaN: too few)."""
        points = self.timeline[:-1]
        if len(points) < 2 or points[-1][0] <= points[0][0]:
            return float("nan")
        (t0, u0), (t1, u1) = points[0], points[-1]
        return (u1 - u0) / (t1 - t0)


def check_output(folder: Path, claims: int, templates: Sequence[str]) -> dict[str, int]:
    """Rows of ``folder`` as ``pandas.read_parquet`` reads them: how many, how many
    (template, claim) pairs twice, and how many expected pairs are missing."""
    import pandas as pd

    df = pd.read_parquet(folder, columns=["template", "claim_id"])
    duplicates = int(df.duplicated().sum())
    found = df.drop_duplicates()
    wanted = found["template"].isin(templates) & found["claim_id"].between(0, claims - 1)
    return {
        "rows": len(df),
        "duplicates": duplicates,
        "missing": claims * len(templates) - int(wanted.sum()),
    }


def measured_run(claims_file: Path, model: str, workers: int, folder: Path) -> dict[str, Any]:
    """run_fever into ``folder``, watched (:class:`Watcher`)."""
    start = time.perf_counter()
    rss_before = psutil.Process().memory_info().rss
    with Watcher(folder) as watch, h.Timer() as wall:
        result = dask_pcm.run_fever(
            data=claims_file,
            model=model,
            output=folder,
            workers=workers,
            claims_per_task=CLAIMS_PER_TASK,
            progress=False,
        )
    report = result.report
    units = report["units"]["total"]
    return {
        "units": units,
        "computed": report["units"]["computed"],
        "tasks": report["tasks"],
        "seconds": wall.seconds,
        "run_fever_seconds": report["wall_seconds"],
        "units_per_s": units / wall.seconds,
        "steady_units_per_s": watch.steady_rate(),
        "index_lines_timed": len(watch.timeline),
        "first_index_seconds": watch.timeline[0][0] - start if watch.timeline else float("nan"),
        "files": report["files"],
        "files_on_disk": len(list(folder.glob(PATTERN))),
        "client_rss_before_mb": rss_before / 2**20,
        "peak_client_rss_mb": watch.peak_rss / 2**20,
        "ru_maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


# -- kill and resume -------------------------------------------------------------------------
def persisted_units(folder: Path) -> set[str]:
    """Units in the segment files of ``folder``, from their footers."""
    import pyarrow.parquet as pq

    found: set[str] = set()
    for path in folder.glob(PATTERN):
        metadata = pq.read_schema(path).metadata or {}
        found.update(json.loads(metadata.get(UNITS_KEY, b"{}")))
    return found


def cli_command(claims_file: Path, model: str, workers: int, folder: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "dask_pcm.cli",
        "fever",
        "--data",
        str(claims_file),
        "--model",
        model,
        "--workers",
        str(workers),
        "--claims-per-task",
        str(CLAIMS_PER_TASK),
        "--output",
        str(folder),
    ]


class Progress:
    """The last ``units: ... N/M`` count a tqdm bar drew on ``stream`` (read in a thread)."""

    PATTERN = re.compile(rb"units:[^\r\n]*?(\d+)/(\d+)")

    def __init__(self, stream: IO[bytes]) -> None:
        self.stream = stream
        self.units = 0
        self.tail = b""
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for chunk in iter(lambda: self.stream.read1(65536), b""):  # type: ignore[attr-defined]
            self.tail = (self.tail + chunk)[-4096:]
            matches = self.PATTERN.findall(self.tail)
            if matches:
                self.units = int(matches[-1][0])

    def join(self) -> None:
        self._thread.join(timeout=10)


def kill_group(proc: subprocess.Popen[bytes]) -> int:
    """SIGKILL ``proc``'s process group; returns how many of its descendants outlived it
    (they are then killed by pid)."""
    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    _, alive = psutil.wait_procs(family, timeout=10)
    for p in alive:
        p.kill()
    return len(alive)


def kill_midway(
    command: list[str], folder: Path, total: int, segment_units: int, env: dict[str, str]
) -> dict[str, Any]:
    """Start ``command``; kill its group once half the units are indexed and the progress
    bar is half a segment further on. Returns what was received and what was persisted."""
    proc = subprocess.Popen(
        command,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
        env=env,
    )
    assert proc.stderr is not None
    progress = Progress(proc.stderr)
    index = IndexReader(folder)
    start = time.monotonic()
    half_at: float | None = None
    try:
        while proc.poll() is None:
            indexed = index.poll()
            if indexed * 2 >= total:
                half_at = half_at or time.monotonic()
                ahead = progress.units - indexed
                if ahead * 2 >= segment_units or time.monotonic() - half_at > 30:
                    break
            time.sleep(KILL_POLL)
        else:
            raise RuntimeError(
                f"the run ended (exit {proc.returncode}) before it could be killed: "
                + progress.tail.decode(errors="replace")[-2000:]
            )
        received = progress.units
        strays = kill_group(proc)
        killed_after = time.monotonic() - start
    finally:
        if proc.poll() is None:
            kill_group(proc)
    progress.join()
    persisted = persisted_units(folder)
    return {
        "kill_at_units": max(received, len(persisted)),
        "kill_progress_units": received,
        "persisted_at_kill": len(persisted),
        "indexed_at_kill": IndexReader(folder).poll(),
        "stray_processes": strays,
        "killed_after_seconds": killed_after,
    }


def resume(command: list[str], report: Path, env: dict[str, str]) -> dict[str, Any]:
    """Run ``command --json report`` to the end; returns its report."""
    done = subprocess.run(
        [*command, "--json", str(report)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
    )
    if done.returncode:
        tail = done.stderr.decode(errors="replace")[-3000:]
        raise RuntimeError(f"the resume failed (exit {done.returncode}):\n{tail}")
    return json.loads(report.read_text())["report"]


def kill_and_resume(
    claims_file: Path, model: str, workers: int, folder: Path, units: int, segment_rows: int
) -> dict[str, Any]:
    command = cli_command(claims_file, model, workers, folder)
    env = {**os.environ, "DASK_PCM__FEVER__SEGMENT_ROWS": str(segment_rows)}
    killed = kill_midway(command, folder, units, segment_rows // CLAIMS_PER_TASK, env)
    print(
        f"CLI killed after {killed['killed_after_seconds']:.1f} s: {killed['kill_at_units']:,} "
        f"units received, {killed['persisted_at_kill']:,} on disk",
        flush=True,
    )
    with h.Timer() as wall:
        report = resume(command, folder.with_suffix(".json"), env)
    computed = report["units"]["computed"]
    persisted, received = killed["persisted_at_kill"], killed["kill_at_units"]
    twice = computed - (units - received)
    return {
        **killed,
        "resume_computed": computed,
        "resume_seconds": wall.seconds,
        "lost_at_kill": received - persisted,
        "recomputed_beyond_unfinished": computed - (units - persisted),
        "recomputed_twice": twice,
        "recompute_pct": 100 * twice / units,
    }


# -- output ----------------------------------------------------------------------------------
def goals(row: dict[str, Any]) -> list[dict[str, Any]]:
    """The figures, with the issue's goal beside those it sets."""

    def figure(name: str, value: str, goal: str = "", met: bool | None = None) -> dict[str, Any]:
        verdict = "" if met is None else "yes" if met else "NO"
        return {"figure": name, "value": value, "goal": goal, "met": verdict}

    r = row
    return [
        figure("claims x templates", f"{r['claims']:,} x {r['templates']}"),
        figure("units (tasks)", f"{r['units']:,} ({r['tasks']:,})"),
        figure(
            "seconds (to the first index line)",
            f"{r['seconds']:.1f} ({r['first_index_seconds']:.1f})",
        ),
        figure("units/s, whole run", f"{r['units_per_s']:.1f}"),
        figure("units/s, steady", f"{r['steady_units_per_s']:.1f}"),
        figure(
            "units/s, in-process before / after / mean",
            f"{r['inproc_units_per_s_before']:.1f} / {r['inproc_units_per_s_after']:.1f} / "
            f"{r['inproc_units_per_s']:.1f} ({r['inproc_sampled_units']:,} units)",
        ),
        figure("ratio steady / in-process", f"{r['ratio']:.2f}", ">= 0.9", r["ratio"] >= 0.9),
        figure(
            "files (report / on disk)",
            f"{r['files']} / {r['files_on_disk']}",
            "<= 1,000",
            r["files_on_disk"] <= 1000,
        ),
        figure(
            "peak client RSS MB (ru_maxrss; before the run)",
            f"{r['peak_client_rss_mb']:.0f} ({r['ru_maxrss_mb']:.0f}; "
            f"{r['client_rss_before_mb']:.0f})",
            "<= 600",
            r["peak_client_rss_mb"] <= 600,
        ),
        figure("rows, duplicates, missing", f"{r['rows']:,}, {r['duplicates']}, {r['missing']}"),
        figure(
            "kill: received / persisted / lost",
            f"{r['kill_at_units']:,} / {r['persisted_at_kill']:,} / {r['lost_at_kill']:,}",
        ),
        figure("resume computed", f"{r['resume_computed']:,} in {r['resume_seconds']:.1f} s"),
        figure(
            "recomputed beyond unfinished",
            f"{r['recomputed_beyond_unfinished']:,}",
            "0",
            r["recomputed_beyond_unfinished"] <= 0,
        ),
        figure(
            "computed twice after the kill",
            f"{r['recomputed_twice']:,} ({r['recompute_pct']:.2f} %)",
            "<= 1 %",
            r["recompute_pct"] <= 1,
        ),
        figure(
            "after resume: rows, duplicates, missing",
            f"{r['resume_rows']:,}, {r['resume_duplicates']}, {r['resume_missing']}",
        ),
    ]


def main() -> None:
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    p = h.parser(__doc__.split("\n\n")[0])
    p.add_argument(
        "--claims", type=int, help=f"claims (default {PAPER_CLAIMS:,}; --quick {QUICK_CLAIMS})"
    )
    p.set_defaults(model=h.TINY)
    args = p.parse_args()
    n = args.claims or (QUICK_CLAIMS if args.quick else PAPER_CLAIMS)
    segment_rows = (
        QUICK_SEGMENT_ROWS if args.quick else int(dask.config.get("pcm.batch.segment-rows"))
    )
    model = h.model_path(args)
    load = os.getloadavg()[0]
    templates = get_templates(None, None)
    names = [t.name for t in templates]

    with (
        tempfile.TemporaryDirectory(
            prefix="dask-pcm-paper-scale-", ignore_cleanup_errors=True
        ) as tmp,
        dask.config.set({"pcm.batch.segment-rows": segment_rows}),
        h.Timer() as total,
    ):
        folder = Path(tmp)
        claims_file = folder / "claims.jsonl"
        write_claims(claims_file, n, source_claims(args.data))
        units, chosen = sample(claims_file, templates, args.quick)
        print(
            f"{n:,} claims x {len(templates)} templates = {units:,} units of "
            f"{CLAIMS_PER_TASK}; {args.workers} workers; segments of {segment_rows} rows; "
            f"model {model}; reference on {len(chosen):,} units; load average {load:.2f}",
            flush=True,
        )
        with Reference(model, chosen, args.workers) as reference:
            before = reference.round()
            print(f"in-process reference: {before:.1f} units/s", flush=True)
            run = measured_run(claims_file, model, args.workers, folder / "run")
            print(
                f"run_fever: {run['seconds']:.1f} s, {run['units_per_s']:.1f} units/s, steady "
                f"{run['steady_units_per_s']:.1f}",
                flush=True,
            )
            after = reference.round()
            print(f"in-process reference: {after:.1f} units/s", flush=True)
        checked = check_output(folder / "run", n, names)
        # --quick kills a one-worker run: one model load fewer per start, on 2 cores.
        kill_workers = 1 if args.quick else args.workers
        kill = kill_and_resume(
            claims_file, model, kill_workers, folder / "killed", units, segment_rows
        )
        resumed = check_output(folder / "killed", n, names)

    inproc = (before + after) / 2
    row = {
        "started": started,
        "load_average": load,
        "claims": n,
        "templates": len(templates),
        "workers": args.workers,
        "model": model,
        "claims_per_task": CLAIMS_PER_TASK,
        "segment_rows": segment_rows,
        **run,
        **checked,
        "inproc_sampled_units": len(chosen),
        "inproc_units_per_s_before": before,
        "inproc_units_per_s_after": after,
        "inproc_units_per_s": inproc,
        "ratio": run["steady_units_per_s"] / inproc,
        "kill_workers": kill_workers,
        **kill,
        **{f"resume_{k}": v for k, v in resumed.items()},
        "total_seconds": total.seconds,
    }
    print()
    h.print_table(goals(row), COLUMNS)
    print(f"\n{total.seconds:.0f} s in all")
    if args.quick:
        print(
            "--quick is a smoke test: its grid is too small for the goals (one segment of "
            f"{segment_rows // CLAIMS_PER_TASK} units is {segment_rows / (n * len(names)):.0%} "
            "of it; the steady window lasts seconds)"
        )
    h.write_json(args.json, [row])
    broken = row["duplicates"] + row["missing"] + row["resume_duplicates"] + row["resume_missing"]
    if broken:
        sys.exit(f"the output folders do not hold every row once: {broken} rows wrong")


if __name__ == "__main__":
    main()
