"""OpenAI Batch files on dask_pcm: shared prefixes found across a file, a 200,000-request file.

Two sections, each on the timing protocol (``_protocol``: rounds in random order, median and
95 % interval, stamped JSON):

1. **Prefixes found.** A file of chat requests (default 512) where 9 in 10 share one long
   system prompt (at least 300 tokens) and the tenth has one of its own, mixed in at random
   as a real file has them; 8 greedy tokens each. Three variants on resident clusters of
   ``--workers`` workers (the model loaded before the timing): ``found`` (the default:
   requests ordered by prefix, each unit's groups keep their prefixes) and ``none``
   (workers that keep no prefix, ``pcm.worker.prefix-cache: 0``: every prompt runs whole,
   which is what a unit mixing one odd request did before), and ``shared``: the same
   requests with every system prompt the long one, on the ``found`` cluster (how close
   the mixed file comes to the best case). Requests per second of each, their ratios
   paired by round, and whether the greedy texts of ``found`` and ``none`` are identical.
2. **A big file.** ``--big`` requests (default 200,000) of a few words each on a tiny random
   Llama (``dask_pcm.build_tiny_llama``: the cost is the harness's, not the model's),
   answered by ``dask-pcm batch`` on a local cluster: the client process's peak resident
   memory (sampled every 50 ms) and the steady rate (requests per second from the first
   counted answer in ``batch.json`` to the end), against the same task over the same units
   in one process of one thread (a worker's share; a sample of ``--one-process``
   requests): ``rate_ratio`` is the steady rate over that (the target: 0.9),
   ``rate_per_worker_ratio`` over ``--workers`` times that (the client, the scheduler and
   the workers share the machine's cores).

Run from the repository root::

    python benchmarks/openai_batch.py --json benchmarks/openai-batch-YYYY-MM-DD.json
    python benchmarks/openai_batch.py --quick        # 128 requests, 20,000 big, 1 round
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dask
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _harness as h
import _protocol as P

import dask_pcm
from dask_pcm.apps.openai_batch import (
    answer,
    prefix_order,
    read_requests,
    run_requests,
)

CHAT = "/v1/chat/completions"
SYSTEM = (
    "You are a careful fact checker working for a research group that studies how claims "
    "spread. For every claim you receive, decide whether the evidence you know of supports "
    "it, refutes it, or is not enough to say. Read the claim twice. Consider who or what it "
    "is about, when it is said to have happened, and whether the numbers, names and places "
    "in it are the ones you know. Do not guess: where you do not know, say that there is "
    "not enough information. Be brief: answer with one of the three labels first, then at "
    "most one sentence of reason. Never repeat the claim. Never add greetings or apologies. "
    "Treat dates and quantities with care, since a claim that is right about a person but "
    "wrong about a year is refuted, not supported. A claim about a fictional work is judged "
    "against the work itself. A claim that mixes two people is refuted. A claim that is "
    "vague is not enough information unless every reading of it is supported or refuted. "
    "Titles of films, books and albums are judged by their release, not by their making. "
    "Awards count only when they were given, not when a person was nominated for them. "
    "Places are judged by the borders of the time the claim speaks of. Organisations are "
    "judged by what they did, not by what they said they would do. Numbers written in "
    "words and in digits are the same number. A claim about a record is judged by the "
    "record of its time, not of today. Translations of a name count as the same name. "
    "When two sources you know disagree, say that there is not enough information. Always "
    "be consistent, and answer every claim on its own, whatever came before it."
)
SUBJECTS = ["Marie Curie", "the Eiffel Tower", "Mount Everest", "the Nile", "Alan Turing",
            "the Great Wall", "Ada Lovelace", "the Amazon", "Isaac Newton", "the Moon"]  # fmt: skip


def prefix_file(path: Path, n: int, seed: int = 0, odd: bool = True) -> Path:
    """``n`` chat requests, 9 in 10 with :data:`SYSTEM`, the tenth with its own (every one
    with :data:`SYSTEM` unless ``odd``), shuffled."""
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        claim = f"{SUBJECTS[i % len(SUBJECTS)]} is mentioned in claim number {i}."
        system = SYSTEM if i % 10 or not odd else f"You judge claims. Claim set {i}: be brief."
        body = {"model": "any", "temperature": 0, "max_tokens": 8,
                "messages": [{"role": "system", "content": system},
                             {"role": "user", "content": claim}]}  # fmt: skip
        lines.append(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": CHAT,
                                 "body": body}))  # fmt: skip
    rng.shuffle(lines)
    path.write_text("\n".join(lines) + "\n")
    return path


def big_file(path: Path, n: int) -> Path:
    with open(path, "w") as f:
        for i in range(n):
            body = {"model": "any", "temperature": 0, "max_tokens": 2,
                    "messages": [{"role": "user", "content": f"Say {i}"}]}  # fmt: skip
            f.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": CHAT,
                                "body": body}) + "\n")  # fmt: skip
    return path


def texts_of(folder: Path) -> dict[str, str]:
    out = {}
    for line in (folder / "output.jsonl").read_text().splitlines():
        record = json.loads(line)
        out[record["custom_id"]] = record["response"]["body"]["choices"][0]["message"]["content"]
    return out


@contextlib.contextmanager
def resident(model: str, workers: int, keep_prefixes: bool) -> Iterator[Any]:
    """A local cluster whose workers hold the model (loaded by a warm-up request)."""
    settings = {} if keep_prefixes else {"pcm.worker.prefix-cache": 0}
    with dask.config.set(settings), h.warm_cluster(model, workers) as client:
        yield client


def section_prefix(args: Any, model: str, reps: int, tmp: Path) -> dict[str, Any]:
    n = args.requests or (128 if args.quick else 512)
    files = {"found": prefix_file(tmp / "prefix.jsonl", n, args.seed)}
    files["none"] = files["found"]
    files["shared"] = prefix_file(tmp / "shared.jsonl", n, args.seed, odd=False)
    tokens = len(dask_pcm.CausalLM(device="cpu")(model).tokenizer(SYSTEM)["input_ids"])
    if tokens < 300 and args.model != h.TINY:
        raise SystemExit(f"the shared system prompt has {tokens} tokens, not the 300 it needs")
    rows: list[dict[str, Any]] = []
    texts: dict[str, dict[str, str]] = {}
    with resident(model, args.workers, True) as found, resident(model, args.workers, False) as none:
        clients = {"found": found, "none": none, "shared": found}
        warm = prefix_file(tmp / "warm.jsonl", 16, args.seed + 1)
        for name, client in {"found": found, "none": none}.items():  # loaded before timing
            run_requests(warm, tmp / f"warm-{name}", model=model, cluster=client,
                         any_model=True, progress=False)  # fmt: skip
        for r, variant in P.schedule(list(clients), reps, args.seed):
            out = tmp / f"{variant}-{r}"
            start = time.perf_counter()
            outcome = run_requests(files[variant], out, model=model, cluster=clients[variant],
                                   any_model=True, progress=False)  # fmt: skip
            seconds = time.perf_counter() - start
            usage = json.loads((out / "batch.json").read_text())["usage"]
            if variant != "shared":  # another file
                texts[f"{variant}-{r}"] = texts_of(out)
            rows.append({"section": "prefix", "variant": variant, "round": r, "requests": n,
                         "seconds": seconds, "requests_per_second": n / seconds,
                         "succeeded": outcome.succeeded,
                         "cached_tokens": usage["input_tokens_details"]["cached_tokens"],
                         "input_tokens": usage["input_tokens"]})  # fmt: skip
            print(f"  round {r} {variant:5s}: {seconds:6.1f} s, {n / seconds:5.1f} requests/s, "
                  f"{rows[-1]['cached_tokens']} cached tokens", flush=True)  # fmt: skip
    rates = P.by_variant(rows, "variant", "requests_per_second")
    first = next(iter(texts.values()))
    return {
        "rows": rows,
        "requests": n,
        "system_prompt_tokens": tokens,
        "found": P.interval(rates["found"]),
        "none": P.interval(rates["none"]),
        "shared": P.interval(rates["shared"]),
        "ratio": P.ratio_interval(rates["found"], rates["none"]),
        "shared_over_found": P.ratio_interval(rates["shared"], rates["found"]),
        "identical_greedy_text": all(t == first for t in texts.values()),
        "target": 3.0,
        "target_shared_over_found": 1.3,
    }


def section_big(args: Any, tmp: Path) -> dict[str, Any]:
    n = args.big or (20_000 if args.quick else 200_000)
    model = str(dask_pcm.build_tiny_llama(tmp / "tiny"))
    path = big_file(tmp / "big.jsonl", n)
    out = tmp / "big"
    # The client is the command's own process (its scheduler inside, as a local run has it);
    # its workers are processes of their own, not counted.
    command = [sys.executable, "-m", "dask_pcm.cli", "batch", "-i", str(path), "-o", str(out),
               "--model", model, "--workers", str(args.workers), "--any-model"]  # fmt: skip
    env = {**os.environ, "DASK_PCM__BATCH__FLUSH_INTERVAL": "1s"}
    start = time.perf_counter()
    run = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    client = psutil.Process(run.pid)
    peak, counted = 0, []
    while run.poll() is None:
        with contextlib.suppress(psutil.Error):
            peak = max(peak, client.memory_info().rss)
        with contextlib.suppress(OSError, ValueError):
            status = json.loads((out / "batch.json").read_text())
            counted.append((time.perf_counter(), status["request_counts"]["completed"]))
        time.sleep(0.05)
    end = time.perf_counter()
    output = run.stdout.read().decode() if run.stdout else ""
    if run.returncode != 0:
        raise RuntimeError(f"dask-pcm batch failed ({run.returncode}): {output[-2000:]}")
    final = json.loads((out / "batch.json").read_text())["request_counts"]["completed"]
    first, done_then = next(((t, d) for t, d in counted if d > 0), (start, 0))
    steady = (final - done_then) / (end - first)
    # The same task over the same units in one process of one thread (a worker's share), on
    # a sample of the requests: the rate the workers would give with no harness at all.
    import torch

    torch.set_num_threads(1)
    sample_n = min(n, args.one_process)
    read = read_requests(big_file(tmp / "sample.jsonl", sample_n))
    rows = prefix_order([r.row for r in read.items if r.row is not None])
    lm = dask_pcm.CausalLM(device="cpu")(model)
    answer(rows[:16], context=lm)  # warm-up
    began = time.perf_counter()
    for i in range(0, len(rows), 16):
        answer(rows[i : i + 16], context=lm)
    alone = sample_n / (time.perf_counter() - began)
    return {
        "requests": n,
        "succeeded": final,
        "wall_seconds": end - start,
        "client_peak_rss_mb": peak / 2**20,
        "steady_requests_per_second": steady,
        "one_process_requests_per_second": alone,
        "rate_ratio": steady / alone,
        "rate_per_worker_ratio": steady / (args.workers * alone),
        "targets": {"client_peak_rss_mb": 600, "rate_ratio": 0.9},
    }


def main() -> None:
    p = h.parser(__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, help="requests of the prefix file (512; --quick 128)")
    p.add_argument("--big", type=int, help="requests of the big file (200,000; --quick 20,000)")
    p.add_argument("--one-process", type=int, default=20_000,
                   help="requests answered in one process for the rate's reference")  # fmt: skip
    p.add_argument("--sections", default="prefix,big", help="prefix, big or both (default)")
    args = p.parse_args()
    reps = P.repetitions(args.quick, args.repetitions)
    sections = set(args.sections.split(","))
    summary: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="openai-batch-bench-") as folder:
        tmp = Path(folder)
        if "prefix" in sections:
            model = h.model_path(args)
            print(f"prefix: model {model}, {args.workers} workers, {reps} rounds", flush=True)
            prefix = section_prefix(args, model, reps, tmp)
            rows += prefix.pop("rows")
            summary["prefix"] = prefix
            print(f"prefix: found/none {P.format_interval(prefix['ratio'])} (target 3), "
                  f"shared/found {P.format_interval(prefix['shared_over_found'])} (target "
                  f"1.3), identical text {prefix['identical_greedy_text']}", flush=True)  # fmt: skip
        if "big" in sections:
            big = section_big(args, tmp)
            summary["big"] = big
            print(f"big: {big['requests']} requests, client peak {big['client_peak_rss_mb']:.0f}"
                  f" MB (target 600), steady {big['steady_requests_per_second']:.0f}/s, one "
                  f"process {big['one_process_requests_per_second']:.0f}/s, ratio "
                  f"{big['rate_ratio']:.2f} (target 0.9)", flush=True)  # fmt: skip
    P.write_json(args.json, rows, reps=reps, summary=summary, workers=args.workers)


if __name__ == "__main__":
    main()
