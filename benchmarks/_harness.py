"""Shared pieces of the dask_pcm benchmarks: options, claims, the scoring task, timing, output.

Every benchmark script in this folder is run as ``python benchmarks/<name>.py`` from a source
checkout and imports this module as ``_harness``. The work unit is the same everywhere: score a
batch of FEVER claims with one forward pass of the language model (:func:`score_batch`), the
code being identical at every context level because it reaches the model through
:func:`dask_pcm.get_context`.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing
import os
import re
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import _protocol

import dask_pcm

# dask_pcm.register and status return tables, and the first of them in a process imports
# pandas (a third of a second): imported here, so that no timed register pays it.
import dask_pcm.status_table
from dask_pcm.apps.fever import LABELS, Claim, PromptTemplate, demo_claims
from dask_pcm.apps.fever import load_claims as read_claims
from dask_pcm.apps.fever.scoring import score_logits

REPO = Path(__file__).resolve().parents[1]

# transformers draws a "Loading weights" bar on every load, hundreds of lines at level agnostic;
# set before any worker or process starts, so that all of them inherit it.
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

DEFAULT_DATA = REPO.parent / "shared" / "data" / "fever" / "paper_dev.jsonl"
CONTEXT = "llm"
TINY = "tiny"  # --model value for the tiny random model (smoke runs)

# The prompt every benchmark scores each claim with: run_fever's own template machinery and
# scoring (dask_pcm.apps.fever), so that the benchmarks time the application's workload.
TEMPLATE = PromptTemplate(
    "benchmark",
    "Is the following claim true, false, or is there not enough information to tell? "
    "Answer with one word: True, False or Unknown.\nClaim: {claim}",
    chat=True,
    answers=("True", "False", "Unknown"),
)


# -- options -------------------------------------------------------------------------------
def parser(description: str | None) -> argparse.ArgumentParser:
    """The options every benchmark takes; a script adds its own to the returned parser."""
    p = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="a small run (smoke test, CI)")
    p.add_argument("--json", metavar="PATH", type=Path, help="also write the results as JSON")
    p.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    p.add_argument(
        "--model",
        metavar="PATH",
        help="model directory or .gguf file (default: the embedded SmolLM2-135M-Instruct); "
        f"'{TINY}': a tiny random Llama (dask_pcm.build_tiny_llama), for smoke runs only",
    )
    p.add_argument(
        "--data",
        metavar="PATH",
        type=Path,
        help=f"FEVER JSON lines (default: {DEFAULT_DATA} if present, else built-in claims)",
    )
    p.add_argument(
        "--repetitions",
        type=int,
        metavar="N",
        help=f"rounds of every variant, each round in random order "
        f"(default {_protocol.DEFAULT_REPETITIONS}, --quick 1)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the rounds' order (default 0)")
    return p


def model_path(args: argparse.Namespace) -> str:
    """The model the benchmark loads; converts the embedded one on first use (~20 s, once).

    ``--model tiny`` builds (once, in ``pcm.cache-directory``) a 0.6 MB random Llama with its
    own small tokenizer: every code path of a benchmark runs, in a fraction of the time, but
    its timings and accuracy say nothing about a real model. ``run_all.py --quick`` uses it.
    """
    if args.model == TINY:
        from dask_pcm import config

        return str(dask_pcm.build_tiny_llama(Path(config.cache_directory()) / "bench-tiny-llama"))
    return str(args.model) if args.model else str(dask_pcm.embedded_model_dir())


# -- claims and scoring ----------------------------------------------------------------------
def load_claims(path: Path | None, n: int) -> list[Claim]:
    """The first ``n`` claims of a FEVER JSON-lines file (:func:`dask_pcm.apps.fever.load_claims`).

    Without ``path``, reads :data:`DEFAULT_DATA` when it exists, else cycles through the
    built-in demo claims (:func:`dask_pcm.apps.fever.demo_claims`), and says so. Either way
    the run's JSON records which (``meta.data``: :func:`_protocol.record_data`).
    """
    if path is None and not DEFAULT_DATA.is_file():
        print(
            f"claims: the built-in demo claims, cycled ({DEFAULT_DATA} not found; --data "
            "names a FEVER file): not comparable with runs on the dev set",
            flush=True,
        )
        _protocol.record_data(source="built-in demo claims", claims=n)
        pool = demo_claims().claims
        return [pool[i % len(pool)] for i in range(n)]
    path = path or DEFAULT_DATA
    claims = read_claims(path).claims
    if len(claims) < n:
        raise ValueError(f"{path} holds {len(claims)} claims, {n} needed")
    _protocol.record_data(source=Path(path).name, sha256=file_sha256(path), claims=n)
    return list(claims[:n])


def file_sha256(path: str | os.PathLike[str]) -> str:
    """The SHA-256 of a file's bytes (hex), read in blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def batches(items: Sequence[Any], size: int) -> list[list[Any]]:
    """``items`` cut into consecutive lists of ``size`` (the last may be shorter)."""
    return [list(items[i : i + size]) for i in range(0, len(items), size)]


def score(lm: Any, claims: Sequence[str], prefix: bool = False) -> list[int]:
    """Predicted label index (into ``LABELS``) of each claim: one forward pass, scored as
    ``run_fever(method="logits")`` scores (:func:`dask_pcm.apps.fever.scoring.score_logits`).

    The prompt goes through the chat template here, on the worker, because the template
    belongs to the tokenizer that lives in the context. With ``prefix``, the template's part
    before the claim is run once per worker and kept (``pcm.worker.prefix-cache``), as
    ``run_fever`` does by default; the predictions are the same.
    """
    prompts = [TEMPLATE.render(c, lm.tokenizer) for c in claims]
    head = None
    if prefix:
        # Here, not at the top: levels.py's task processes import this module without
        # Dask, and dask_pcm.apps.fever.units brings it in.
        from dask_pcm.apps.fever.units import template_head

        head = template_head(TEMPLATE, lm.tokenizer)
    rows = score_logits(lm, prompts, TEMPLATE.answers, prefix=head)
    return [LABELS.index(r["predicted"]) for r in rows]


def score_batch(claims: Sequence[str], context: str = CONTEXT, prefix: bool = False) -> list[int]:
    """The benchmark task: score ``claims`` with the context's model, whatever its level."""
    return score(dask_pcm.get_context(context), claims, prefix)


def accuracy(predictions: Sequence[int], claims: Sequence[Claim]) -> float:
    hits = sum(LABELS[p] == c.label for p, c in zip(predictions, claims, strict=True))
    return hits / len(claims)


def warm_up(model: str) -> None:
    """Load ``model`` once and drop it; run it in every worker (``client.run``) before timing.

    The first load in a process also imports torch, transformers and their lazily imported
    tokenizer and model code (about 3 s here): a per-process cost, not a per-context one, which
    would otherwise land in the first task at levels agnostic and partial but in ``register``
    at full.
    """
    loader = dask_pcm.CausalLM()
    loader.release(loader(model))


@contextmanager
def warm_cluster(model: str, workers: int) -> Iterator[Any]:
    """A client of a fresh ``dask_pcm.local_cluster`` of ``workers`` x 1 thread, every worker
    present and warmed up (:func:`warm_up`); cluster and client closed on exit."""
    from distributed import Client

    with (
        dask_pcm.local_cluster(
            n_workers=workers, threads_per_worker=1, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
    ):
        client.wait_for_workers(workers)
        client.run(warm_up, model)
        yield client


# -- the ideal baseline: bare processes, no Dask ----------------------------------------------
@contextmanager
def _worker_environ() -> Iterator[None]:
    """The environment a dask_pcm worker process starts with: the nanny's pre-spawn
    variables (one OpenMP/MKL/OpenBLAS thread) minus ``MALLOC_TRIM_THRESHOLD_``."""
    import dask.config

    env = {k: str(v) for k, v in dask.config.get("distributed.nanny.pre-spawn-environ").items()}
    env.pop("MALLOC_TRIM_THRESHOLD_", None)
    saved = dict(os.environ)
    os.environ.pop("MALLOC_TRIM_THRESHOLD_", None)  # glibc reads it at start: must not inherit
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _ideal_process(model: str, queue: Any, barrier: Any, out: Any) -> None:
    try:
        import torch

        torch.set_num_threads(1)
        start = time.perf_counter()
        lm = dask_pcm.CausalLM()(model)
        load_seconds = time.perf_counter() - start
        barrier.wait()
        cpu = time.process_time()
        predictions = {}
        while (item := queue.get()) is not None:
            i, claims = item
            predictions[i] = score(lm, claims)
        out.put((load_seconds, time.process_time() - cpu, predictions))
    except BaseException as exc:
        barrier.abort()
        out.put(f"{type(exc).__name__}: {exc}")


def ideal(model: str, work: Sequence[list[str]], processes: int) -> dict[str, Any]:
    """Score ``work`` (batches of claim texts) in ``processes`` bare spawned processes.

    Each process loads the model once with :class:`dask_pcm.CausalLM`; once all have loaded
    they take batches from one shared queue, the next as soon as one is scored, as a
    scheduler with no overhead would hand them out (a static round-robin split would leave a
    process idle while another finishes its share, and make the ideal beatable).

    Returns a dict with ``predictions`` (per batch, in order), ``load_seconds`` (the model
    loads, summed over processes; the first load in a process includes lazy imports),
    ``startup_seconds`` (from the start to all models loaded: process start-up, imports, loads),
    ``wall_seconds`` (from all loaded to all done), ``tasks_per_process`` and ``cpu_seconds``
    (CPU time the processes used while scoring, summed).
    """
    mp = multiprocessing.get_context("spawn")
    barrier = mp.Barrier(processes + 1)
    out, queue = mp.Queue(), mp.Queue()
    for item in enumerate(work):
        queue.put(item)
    for _ in range(processes):
        queue.put(None)  # one end-of-work mark per process
    procs = [
        mp.Process(target=_ideal_process, args=(model, queue, barrier, out))
        for _ in range(processes)
    ]
    start = time.perf_counter()
    with _worker_environ():
        for p in procs:
            p.start()
    try:
        barrier.wait(timeout=600)
        loaded = time.perf_counter()
        parts = [out.get(timeout=3600) for _ in procs]
        done = time.perf_counter()
    except threading.BrokenBarrierError:  # a process failed to load, or the load timed out
        parts = [out.get(timeout=10)]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    errors = [part for part in parts if isinstance(part, str)]
    if errors:
        raise RuntimeError(f"an ideal process failed: {errors[0]}")
    results = {i: preds for _, _, part in parts for i, preds in part.items()}
    return {
        "predictions": [results[i] for i in range(len(work))],
        "load_seconds": sum(load for load, _, _ in parts),
        "startup_seconds": loaded - start,
        "wall_seconds": done - loaded,
        "cpu_seconds": sum(cpu for _, cpu, _ in parts),
        "tasks_per_process": [len(part) for _, _, part in parts],
    }


# -- timing and output ---------------------------------------------------------------------
class Lines:
    """Every line (``\\r`` or ``\\n`` ended) of ``stream``, read in a thread, stamped with the
    seconds from ``start`` to the arrival of its first byte.

    Stamped at its first byte, not at its end: a progress bar writes ``\\r`` *before* each
    state, so a state's line ends only when the next state arrives; stamped at its end,
    the first unit of a run with a few slow units would show up one unit late.
    """

    def __init__(self, stream: IO[bytes], start: float) -> None:
        self.stream, self.start = stream, start
        self.lines: list[tuple[float, str]] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        rest, since = b"", 0.0  # an unfinished line, and when its first byte came
        for chunk in iter(lambda: self.stream.read1(65536), b""):  # type: ignore[attr-defined]
            now = time.perf_counter() - self.start
            parts = re.split(rb"[\r\n]", rest + chunk)
            last = parts.pop()
            for i, part in enumerate(parts):
                if part.strip():
                    at = since if i == 0 and rest else now
                    self.lines.append((at, part.decode("utf-8", "replace")))
            since = since if (rest and not parts) else now
            rest = last
        if rest.strip():
            self.lines.append((since, rest.decode("utf-8", "replace")))

    def join(self) -> None:
        self._thread.join(timeout=30)


def stamped_run(
    argv: Sequence[str], env: dict[str, str], cwd: Path, start: float | None = None
) -> tuple[list[tuple[float, str]], float]:
    """Run ``argv`` to its end, output ignored, each line of its standard error stamped
    (:class:`Lines`) with the seconds from ``start`` (default: now); its lines and the
    seconds it took. RuntimeError with its last lines when it fails."""
    start = time.perf_counter() if start is None else start
    proc = subprocess.Popen(
        list(argv), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=cwd
    )
    assert proc.stderr is not None
    lines = Lines(proc.stderr, start)
    code = proc.wait(timeout=1800)
    seconds = time.perf_counter() - start
    lines.join()
    if code:
        tail = "\n".join(text for _, text in lines.lines[-30:])
        raise RuntimeError(f"{' '.join(argv[-12:])} failed (exit {code}):\n{tail}")
    return lines.lines, seconds


class Timer:
    """``with Timer() as t: ...`` then ``t.seconds`` (wall clock, ``time.perf_counter``)."""

    seconds: float = float("nan")

    def __enter__(self) -> Timer:
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self._start


Column = tuple[str, str, str]  # (key, header, format spec)


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[Column]) -> None:
    """Print ``rows`` as a fixed-width table; numbers right-aligned, text left-aligned."""
    cells = [[format(row[key], spec) for key, _, spec in columns] for row in rows]
    widths = [
        max([len(header)] + [len(r[j]) for r in cells]) for j, (_, header, _) in enumerate(columns)
    ]
    numeric = [all(isinstance(row[key], int | float) for row in rows) for key, _, _ in columns]

    def line(values: Sequence[str]) -> str:
        return "  ".join(
            v.rjust(w) if num else v.ljust(w)
            for v, w, num in zip(values, widths, numeric, strict=True)
        ).rstrip()

    print(line([header for _, header, _ in columns]))
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print(line(r))


def plot_bars(
    path: Path | None,
    rows: Sequence[dict[str, Any]],
    label: str,
    value: str,
    *,
    title: str,
    ylabel: str,
    group: str | None = None,
) -> None:
    """Save a bar chart of ``row[value]`` per ``row[label]`` as PNG next to the JSON.

    With ``group``, bars of the same label sit side by side, one colour per group value
    (e.g. label "n", group "mode"). ``path`` is the JSON path; the plot goes to
    ``<path without .json>.png``. Nothing happens without a path.
    """
    if path is None:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(str(r[label]) for r in rows))
    groups = list(dict.fromkeys(str(r[group]) for r in rows)) if group else [""]
    width = 0.8 / len(groups)
    fig, ax = plt.subplots(figsize=(max(4.0, 0.9 * len(labels) * len(groups) + 2), 3.6))
    for j, g in enumerate(groups):
        xs, ys = [], []
        for i, lab in enumerate(labels):
            for r in rows:
                if str(r[label]) == lab and (not group or str(r[group]) == g):
                    xs.append(i + (j - (len(groups) - 1) / 2) * width)
                    ys.append(r[value])
        bars = ax.bar(xs, ys, width=width, label=g or None)
        ax.bar_label(bars, fmt="%.3g", fontsize=8)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_xlabel(label)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    if group:
        ax.legend(title=group, fontsize=8)
    save_figure(fig, path)


def save_figure(fig: Any, path: Path) -> None:
    """Save matplotlib ``fig`` as the PNG beside the JSON ``path``, and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    png = path.with_suffix(".png")
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    print(f"plot written to {png}")


def write_json(
    path: Path | None,
    rows: Sequence[dict[str, Any]],
    *,
    reps: int = 1,
    summary: Any = None,
    **extra_meta: Any,
) -> None:
    """Write ``rows`` (flat dicts) and ``summary`` to ``path``, stamped with the run's
    ``meta`` (:func:`_protocol.write_json`); nothing without a path."""
    _protocol.write_json(path, rows, reps=reps, summary=summary, **extra_meta)
