"""Engines side by side: vLLM's own ``run_batch``, ``dask-pcm batch --engine vllm`` and the
Hugging Face engine on one OpenAI request file; FEVER scoring on both engines (issue 42).

Runs in a venv with vLLM (``bash ci/vllm/setup.sh``), so that every variant has the same torch.
The request file: ``--requests`` chat completions (256), each a user message of 1 to 6
sentences, two in three after one long shared system prompt, ``max_tokens`` 8, 16 or 32,
temperature 0; the embedded SmolLM2-135M-Instruct (its converted folder) answers. Variants,
each a fresh command, interleaved in a random order per round (:mod:`_protocol`):

- ``run_batch``: ``python -m vllm.entrypoints.openai.run_batch`` (float32, eager, the same
  4 GiB KV cache dask_pcm gives a vLLM engine on this host);
- ``vllm``: ``dask-pcm batch --engine vllm`` on one local worker (the cores as its threads);
- ``hf``: ``dask-pcm batch`` on the Hugging Face engine (its default local cluster);
- ``fever_vllm``, ``fever_hf``: ``dask-pcm fever --engine vllm|hf`` on ``--claims`` claims of
  FEVER's dev set (``../shared/data/fever/paper_dev.jsonl`` when present, else the demo claims)
  under 3 templates.

Figures (seconds from the command's start, each line stamped at its first byte):
``ready_at`` (``run_batch``: its progress bar appears, at 0; dask_pcm: the first worker has its
context ready), ``first_answer_at`` (dask_pcm: the first unit is back; ``run_batch`` writes its
answers at its end), ``done_at`` (the last request answered: ``run_batch``'s bar at 100 %,
dask_pcm's units all back), ``seconds`` (the whole command), ``per_second`` (requests or
claims per second after start-up: their number over ``done_at - ready_at``),
``tokens_per_second`` (generated tokens, from the answers' usage, over the same span),
``peak_rss_mb`` (the command's process tree, sampled every 0.2 s). Summary: per variant the
median and interval of each, and per round the ratios ``vllm / run_batch`` and
``hf / run_batch`` of ``per_second``, and how many greedy answers ``vllm`` and ``hf`` gave
identical to ``run_batch``'s.

Then once, what ``run_batch`` cannot do: ``dask-pcm batch --engine vllm`` killed (SIGKILL to
its whole process group) once a third of its units is written, and run again: the rerun
answers only what was missing (``resume`` in the JSON: units reused and computed, every
request answered once). ``modes`` (``--modes``): the same ``vllm`` command with
``distributed.worker.daemon: False`` (vLLM's engine core in a child process), against the
engine in the worker's process.

Examples::

    .venv-vllm/bin/python benchmarks/engines.py --json benchmarks/engines-<date>.json
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import _harness as h
import _protocol
import first_answer
import psutil

BATCH = ("run_batch", "vllm", "hf")
FEVER = ("fever_vllm", "fever_hf")
FIGURES = ("ready_at", "first_answer_at", "done_at", "seconds", "per_second",
           "tokens_per_second", "peak_rss_mb")  # fmt: skip
COLUMNS = [("round", "round", "d"), ("variant", "variant", "s"), ("ready_at", "ready", ".1f"),
           ("first_answer_at", "1st answer", ".1f"), ("done_at", "done", ".1f"),
           ("seconds", "whole", ".1f"), ("per_second", "per s", ".2f"),
           ("tokens_per_second", "tokens/s", ".1f"), ("peak_rss_mb", "peak MB", ".0f")]  # fmt: skip
KV_BYTES = 4 << 30
SYSTEM = (
    "You are a careful assistant for a science museum. Answer the visitor's question in one "
    "or two plain sentences, with no lists, no headings and no follow-up questions. Prefer "
    "what is certain to what is speculative, say so when something is not known, and keep "
    "numbers exact. Do not repeat the question. "
) * 3
SENTENCES = ("Tell me about the number {i}.", "I saw it on a poster in the main hall.",
             "My daughter asked me and I did not know.", "Please keep it short.",
             "Is there anything surprising about it?", "We are visiting from far away.")  # fmt: skip
DEV = Path(__file__).resolve().parents[2] / "shared" / "data" / "fever" / "paper_dev.jsonl"


def write_requests(path: Path, n: int, model: str) -> None:
    with path.open("w") as f:
        for i in range(n):
            text = " ".join(s.format(i=i) for s in SENTENCES[: 1 + i % len(SENTENCES)])
            messages = [{"role": "user", "content": text}]
            if i % 3:
                messages.insert(0, {"role": "system", "content": SYSTEM})
            body = {"model": model, "messages": messages, "max_tokens": (8, 16, 32)[i % 3],
                    "temperature": 0}  # fmt: skip
            f.write(json.dumps({"custom_id": f"q{i:04d}", "method": "POST",
                                "url": "/v1/chat/completions", "body": body}) + "\n")  # fmt: skip


def write_claims(path: Path, n: int) -> Path | None:
    if not DEV.is_file():
        return None
    lines = DEV.read_text().splitlines()[:n]
    path.write_text("\n".join(lines) + "\n")
    return path


def command(variant: str, folder: Path, model: str, extra: tuple[str, ...] = ()) -> list[str]:
    if variant == "run_batch":
        return [sys.executable, "-m", "vllm.entrypoints.openai.run_batch", "-i",
                str(folder / "requests.jsonl"), "-o", str(folder / "run_batch.jsonl"),
                "--model", model, "--served-model-name", Path(model).name, "--dtype",
                "float32", "--enforce-eager", "--kv-cache-memory-bytes", str(KV_BYTES)]  # fmt: skip
    cli = [sys.executable, "-c", first_answer._CLI]  # the CLI, its workers' INFO lines kept
    engine = "vllm" if variant.endswith("vllm") else "hf"
    if variant.startswith("fever"):
        data = folder / "claims.jsonl"
        claims = ["--data", str(data)] if data.is_file() else []
        return [*cli, "fever", *claims, "--engine", engine, "--num-templates", "3",
                "--model", model, *extra]  # fmt: skip
    workers = ["--workers", "1"] if engine == "vllm" else []
    return [*cli, "batch", "-i", str(folder / "requests.jsonl"), "-o", str(folder / variant),
            "--engine", engine, "--model", model, *workers, *extra]  # fmt: skip


class Peak:
    """The largest resident memory of a process and its descendants, sampled every 0.2 s."""

    def __init__(self, pid: int) -> None:
        self.pid, self.bytes = pid, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            try:
                root = psutil.Process(self.pid)
                procs = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            total = 0
            for p in procs:
                with contextlib.suppress(psutil.NoSuchProcess):
                    total += p.memory_info().rss
            self.bytes = max(self.bytes, total)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def run(argv: list[str], folder: Path, kill_when: Any = None) -> tuple[list, float, int, int]:
    """Run ``argv`` in its own session, stderr stamped; ``kill_when()`` true kills its whole
    process group. Its lines, seconds, peak bytes and exit code."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "DASK_LOGGING__DASK_PCM": "info",
           "HF_HUB_DISABLE_PROGRESS_BARS": "1", "DASK_PCM__BATCH__FLUSH_INTERVAL": "0"}  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
                            cwd=folder, start_new_session=True)  # fmt: skip
    assert proc.stderr is not None
    lines, peak = h.Lines(proc.stderr, start), Peak(proc.pid)
    while proc.poll() is None:
        if kill_when is not None and kill_when():
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            break
        time.sleep(0.2)
    seconds = time.perf_counter() - start
    peak.stop()
    lines.join()
    if proc.returncode and kill_when is None:
        tail = "\n".join(text for _, text in lines.lines[-30:])
        raise RuntimeError(f"{' '.join(argv[-14:])} failed (exit {proc.returncode}):\n{tail}")
    return lines.lines, seconds, peak.bytes, proc.returncode


def answers(path: Path) -> dict[str, tuple[str, int]]:
    """``custom_id`` → (text, completion tokens) of an output file."""
    out = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        body = record["response"]["body"]
        out[record["custom_id"]] = (body["choices"][0]["message"]["content"],
                                    body["usage"]["completion_tokens"])  # fmt: skip
    return out


def measure(variant: str, folder: Path, model: str, n: int) -> dict[str, Any]:
    target = folder / variant
    subprocess.run(["rm", "-rf", str(target), str(folder / "run_batch.jsonl")], check=True)
    lines, seconds, peak, _ = run(command(variant, folder, model), folder)
    nan = float("nan")
    row: dict[str, Any] = dict.fromkeys(FIGURES, nan)
    row.update(seconds=seconds, peak_rss_mb=peak / 2**20)
    if variant == "run_batch":
        for at, text in lines:
            if "Running batch:" in text and row["ready_at"] != row["ready_at"]:
                row["ready_at"] = at
            if "Running batch: 100%" in text and row["done_at"] != row["done_at"]:
                row["done_at"] = at
        row["first_answer_at"] = seconds  # written at the end
        if row["ready_at"] != row["ready_at"] or row["done_at"] != row["done_at"]:
            shown = "\n".join(t for _, t in lines if "batch" in t.lower())[-3000:]
            raise RuntimeError(f"run_batch's start or end not found in its output:\n{shown}")
        got = answers(folder / "run_batch.jsonl")
    else:
        stamps = first_answer.timeline(lines)
        row.update(ready_at=stamps["first_ready_at"], first_answer_at=stamps["first_unit_at"],
                   done_at=stamps["last_unit_at"])  # fmt: skip
        got = answers(target / "output.jsonl") if variant in BATCH else {}
    span = row["done_at"] - row["ready_at"]
    row["per_second"] = n / span
    if got:
        assert len(got) == n, f"{variant} answered {len(got)} of {n} requests"
        row["tokens_per_second"] = sum(t for _, t in got.values()) / span
        (folder / f"{variant}.answers.json").write_text(json.dumps(got))
    return {**row, "load_average": os.getloadavg()[0]}


def same_as_run_batch(folder: Path, variant: str) -> int:
    ours = json.loads((folder / f"{variant}.answers.json").read_text())
    theirs = json.loads((folder / "run_batch.answers.json").read_text())
    return sum(ours[k][0] == theirs[k][0] for k in theirs)


def units_written(folder: Path) -> set[str]:
    """The units an output folder's index says are written."""
    index = folder / "_dask_pcm_index.jsonl"
    if not index.is_file():
        return set()
    done: set[str] = set()
    for line in index.read_text().splitlines():
        with contextlib.suppress(ValueError, KeyError):  # a line cut by the kill
            done.update(json.loads(line)["units"])
    return done


def resume(folder: Path, model: str, n: int) -> dict[str, Any]:
    """``vllm`` killed once a third of its units is written, then run again."""
    target = folder / "vllm"
    subprocess.run(["rm", "-rf", str(target)], check=True)
    units = -(-n // 16)
    _, killed_after, _, code = run(
        command("vllm", folder, model), folder, lambda: len(units_written(target)) * 3 >= units
    )
    kept = units_written(target)
    _, seconds, _, _ = run(command("vllm", folder, model), folder)
    got = [json.loads(x)["custom_id"] for x in (target / "output.jsonl").read_text().splitlines()]
    total = units_written(target)
    return {"killed_after": killed_after, "exit_code": code, "units": units,
            "units_kept_at_kill": len(kept), "units_after_rerun": len(total),
            "kept_units_still_there": kept <= total, "rerun_seconds": seconds,
            "answered": len(got), "distinct": len(set(got)), "requests": n}  # fmt: skip


def main() -> None:
    p = h.parser(__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=None, help="chat requests (256)")
    p.add_argument("--claims", type=int, default=None, help="FEVER claims (300)")
    p.add_argument("--modes", action="store_true", help="also daemon=False against in-process")
    args = p.parse_args()
    reps = _protocol.repetitions(args.quick, args.repetitions)
    n = args.requests or (48 if args.quick else 256)
    claims = args.claims or (30 if args.quick else 300)
    from dask_pcm.templates.sources import EMBEDDED, resolve_source

    model = str(resolve_source(EMBEDDED).path)
    rows: list[dict[str, Any]] = []
    extra: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="dask-pcm-engines-") as tmp:
        folder = Path(tmp)
        write_requests(folder / "requests.jsonl", n, Path(model).name)
        used = write_claims(folder / "claims.jsonl", claims)
        counts = {v: n for v in BATCH} | {v: (claims if used else 30) * 3 for v in FEVER}
        variants = [*BATCH, *FEVER]
        for r, variant in _protocol.schedule(variants, reps, args.seed):
            row = {"round": r, "variant": variant,
                   **measure(variant, folder, model, counts[variant])}  # fmt: skip
            if variant in ("vllm", "hf") and (folder / "run_batch.answers.json").is_file():
                row["same_as_run_batch"] = same_as_run_batch(folder, variant)
            rows.append(row)
            print(f"round {r} {variant}: {row['per_second']:.2f}/s after start-up, whole "
                  f"{row['seconds']:.1f} s (load {row['load_average']:.1f})", flush=True)  # fmt: skip
        # Texts compared once every variant of the last round has run.
        for row in rows:
            if row["variant"] in ("vllm", "hf") and row["round"] == reps - 1:
                row["same_as_run_batch"] = same_as_run_batch(folder, row["variant"])
        extra["resume"] = resume(folder, model, n)
        print("resume:", extra["resume"], flush=True)
        if args.modes:
            modes = []
            for r, mode in _protocol.schedule(["in_process", "daemon_false"], reps, args.seed):
                env = (
                    {"DASK_DISTRIBUTED__WORKER__DAEMON": "False"} if mode == "daemon_false" else {}
                )
                saved = dict(os.environ)
                os.environ.update(env)
                try:
                    row = measure("vllm", folder, model, n)
                finally:
                    os.environ.clear()
                    os.environ.update(saved)
                modes.append({"round": r, "mode": mode, **row})
                print(f"round {r} {mode}: whole {row['seconds']:.1f} s", flush=True)
            extra["modes"] = modes
    print()
    h.print_table(rows, COLUMNS)
    summary: dict[str, Any] = {"intervals": []}
    for variant in variants:
        mine = [r for r in rows if r["variant"] == variant]
        for name in FIGURES:
            values = [r[name] for r in mine]
            if values and all(v == v and v > 0 for v in values):
                summary["intervals"].append({"variant": variant, "figure": name,
                                             **_protocol.interval(values)})  # fmt: skip
    rate = _protocol.by_variant(rows, "variant", "per_second")
    for variant in ("vllm", "hf"):
        summary[f"{variant}_over_run_batch"] = _protocol.ratio_interval(rate[variant],
                                                                         rate["run_batch"])  # fmt: skip
    summary["fever_vllm_over_hf"] = _protocol.ratio_interval(rate["fever_vllm"], rate["fever_hf"])
    if "modes" in extra:
        whole = _protocol.by_variant(extra["modes"], "mode", "seconds")
        summary["daemon_false_over_in_process"] = _protocol.ratio_interval(
            whole["daemon_false"], whole["in_process"]
        )
    print(json.dumps(summary, indent=1))
    h.write_json(args.json, rows, reps=reps, summary=summary, requests=n,
                 claims=claims if used else 30, model="embedded", **extra)  # fmt: skip


if __name__ == "__main__":
    main()
