"""Prompt-prefix reuse: FEVER claims/s per template with the template's head kept, and without.

Every prompt of a template starts with the same text (instructions, examples, the chat
preamble); only the claim and what follows it differ. With prefix reuse the model runs that
shared head once per worker, keeps its key/value states (``pcm.worker.prefix-cache``) and
runs only each prompt's own tokens; without it every prompt runs in full. This script
measures what that buys on the FEVER workload, template by template, and checks that it
changes no prediction.

Per built-in template (``dask_pcm.apps.fever.get_templates``; ``--templates`` to choose; ``--quick``:
few-shot and direct), N FEVER dev claims (default 128, ``--quick`` 32) in tasks of 32
(``--claims-per-task``; ``run_fever``'s default, ``dask_pcm.apps.fever.run.CLAIMS_PER_TASK``),
each task ``dask_pcm.apps.fever.units.score_unit(template, claims, "logits",
prefix_cache=True|False)``, the task a FEVER run sends, submitted with
``dask_pcm.submit``. The model is the embedded SmolLM2-135M-Instruct by default, resident at
level ``full`` on one fresh ``dask_pcm.local_cluster`` (2 workers x 1 thread by default); on a
CPU worker it runs at most 8 whole prompts per forward pass, so a task of 32 claims is 4
passes without reuse, and one pass with it (its claims' own tokens packed, up to
8 sequences of 256 tokens).

Per template: an untimed warm-up, then ``--repetitions`` (default 3, ``--quick`` 1), each one
round with prefix reuse and one without, back to back, in a seeded random order (``--seed``,
``_protocol``), so that a slow stretch of this shared machine falls on both modes alike; the
ratio is summarised by its median, range and 95 % interval over the repetitions. A round
scores all N claims; its claims/s is N over the seconds from submitting its tasks to having
every result, so a round's fixed cost (submitting, gathering) counts against the faster mode:
N is large enough that a round with reuse lasts seconds, not one task per worker. The
warm-up pays each worker's slower first passes on new shapes and fills the prefix cache:
every task of the round is sent with prefix reuse once to every worker (pinned), then the
round runs once without. The timed "with" rounds therefore measure the steady state where the prefix states are resident, which
is the point of keeping them: a worker computes a template's prefix once and serves every
later task of that template from it. That one-time cost is measured apart (``prefix_ms``).

Columns, one row per template:

- ``tokens``: tokens per prompt, mean over the N claims, counted with the model's tokenizer
  in this process (chat preamble included).
- ``prefix``: tokens every prompt of a task shares with the template's head
  (``dask_pcm.engine.prefix.shared_prefix``; the token where the head meets the claim is not
  shared when the two merge), the part run once per worker; ``a-b`` when tasks differ.
- ``run w/o``, ``run with``: token positions a forward pass runs per claim, padding included,
  as the model batches them (prompts sorted by length; whole prompts in passes of 8 padded
  rows; after the kept prefix, end to end: where the model's attention allows block-local
  attention (``dask_pcm.engine.attention``, the embedded model's does) a pass's rows as one
  sequence without padding, the claims' own tokens only; else packed in sequences of up to
  256 tokens, 8 sequences a pass, balanced: as few as that takes, the longest as short as
  it can be, padded to the pass's longest): what the work shrinks to.
- ``w/o c/s``, ``with c/s``: median claims/s over the repetitions.
- ``ratio``: median with / median without; ``range``: the lowest and highest ratio of one
  repetition's pair (the pairs are printed below the table); the JSON has the 95 % interval
  of the pairs' ratios (``ratio_low``, ``ratio_high``).
- ``bound``: ``run w/o`` / ``run with``, the speed-up if a position ran as fast with reuse
  as without; ``pos/s ratio``: positions per second with reuse over without (``ratio`` /
  ``bound``), which the issue wants at 0.9 or more: what fixed costs per pass and per task
  (the head, reading the weights, scheduling) take of the gain.
- ``task ratio``: the same ratio from the tasks' compute time on the workers (Dask's task
  stream), summed per round: the forward passes without the round trips and without the
  wait for the slower worker at the end of a round.
- ``target``: the issue's goal (few-shot and chat-few-shot at least 4x, few-shot with the
  low end of the interval at least 3.5, direct at least 1.5x), and whether it is met.
- ``same``: predictions (labels) identical to the first round without reuse, in every round
  of the template; ``max |d|``: largest absolute difference of a label score
  (log-probability) from that round. Any changed label fails the run (exit status 1).
- ``prefix_ms``: the one-time cost, one forward pass over the prefix tokens on a worker
  (median of 3, mean over workers), what the first task of a template pays on each worker.

The generation section (``--no-generate`` leaves it out): the same claims under few-shot,
each task generating 8 greedy tokens per claim (``score_generate``, what ``--method
generate`` runs) from the kept head and from whole prompts, warmed up and paired the same
way; its goal is 2x, with every round's texts identical to the first round's without reuse.

The figures come from one machine: compare the two modes of one template, which ran side by
side, rather than digits across runs. A ratio below the token ratio means costs that do not
shrink with the tokens (per pass: copying the kept states into the pass, the model's fixed
per-call work, tokenising; per round: scheduling and the last task's tail).

Examples::

    python benchmarks/prefix.py --quick
    python benchmarks/prefix.py --json /tmp/prefix.json
    python benchmarks/prefix.py --templates few-shot,chat-few-shot --repetitions 5
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import _harness as h
import _protocol as P
from distributed import Client, get_task_stream

import dask_pcm
from dask_pcm.apps.fever import Claim, PromptTemplate, get_templates
from dask_pcm.apps.fever.run import CLAIMS_PER_TASK
from dask_pcm.apps.fever.scoring import score_generate
from dask_pcm.apps.fever.units import CONTEXT, score_unit, template_head
from dask_pcm.engine.attention import applies
from dask_pcm.engine.prefix import (
    MIN_PREFIX_TOKENS,
    PACK_TOKENS,
    balanced,
    pack,
    packable,
    prefix_states,
    shared_prefix,
)

QUICK_TEMPLATES = "few-shot,direct"
# The goals (32): speed-up of claims/s with prefix reuse over without, and the least
# low end of its 95 % interval where one is set.
TARGETS = {"few-shot": 4.0, "chat-few-shot": 4.0, "direct": 1.5}
TARGET_LOW = {"few-shot": 3.5}
# The generation section: one template, new tokens per claim, its goal (claims/s with / without).
GENERATE_TEMPLATE = "few-shot"
GENERATE_TOKENS = 8
GENERATE_TARGET = 2.0
# The per-position rate with reuse over without that the issue asks for (items 1).
RATE_TARGET = 0.9
MODES = ("with", "without")
COLUMNS = [
    ("template", "template", ""),
    ("prompt_tokens", "tokens", ".1f"),
    ("prefix", "prefix", ""),
    ("run_tokens_without", "run w/o", ".1f"),
    ("run_tokens_with", "run with", ".1f"),
    ("claims_per_second_without", "w/o c/s", ".2f"),
    ("claims_per_second_with", "with c/s", ".2f"),
    ("ratio", "ratio", ".2f"),
    ("ratio_range", "range", ""),
    ("bound", "bound", ".2f"),
    ("rate_ratio", "pos/s ratio", ".2f"),
    ("task_ratio", "task ratio", ".2f"),
    ("target_text", "target", ""),
    ("same_text", "same", ""),
    ("max_score_diff", "max |d|", ".1e"),
    ("prefix_ms", "prefix_ms", ".1f"),
]
PAIR_COLUMNS = [
    ("template", "template", ""),
    ("repeat", "rep", "d"),
    ("first", "first", ""),
    ("seconds_with", "with s", ".2f"),
    ("seconds_without", "w/o s", ".2f"),
    ("claims_per_second_with", "with c/s", ".2f"),
    ("claims_per_second_without", "w/o c/s", ".2f"),
    ("ratio", "ratio", ".2f"),
    ("task_ratio", "task ratio", ".2f"),
]


# -- on the workers ----------------------------------------------------------------------------
def worker_model() -> dict[str, Any]:
    """What the worker's resident model runs with: prompts per pass and the prefix cache."""
    lm = dask_pcm.get_context(CONTEXT)
    cache = lm.prefix_cache
    return {
        "batch_size": int(lm.batch_size),
        "prefix_cache_limit": None if cache is None else int(cache.limit),
        "prefix_entries": 0 if cache is None else len(cache),
        "prefix_cache_bytes": int(lm.prefix_cache_bytes),
        "packable": packable(lm.model),
        "by_rows": applies(lm.model),
    }


def generate_task(template: PromptTemplate, claims: Sequence[Claim], prefix: bool) -> list[str]:
    """The generation section's task: ``GENERATE_TOKENS`` greedy tokens after each claim's
    prompt (``score_generate``, what ``--method generate`` runs), from the template's kept
    head or from whole prompts; the texts."""
    lm = dask_pcm.get_context(CONTEXT)
    prompts = [template.render(c.claim, lm.tokenizer) for c in claims]
    head = template_head(template, lm.tokenizer) if prefix else None
    rows = score_generate(lm, prompts, template.answers, GENERATE_TOKENS, prefix=head)
    return [row["generated"] for row in rows]


def prefix_seconds(template: PromptTemplate, claims: Sequence[Claim]) -> float:
    """Seconds of one forward pass over the prefix ``claims`` share under ``template``: what
    computing the kept states costs, once per worker (median of 3; not stored)."""
    lm = dask_pcm.get_context(CONTEXT)
    with lm.lock:
        ids = lm.tokenizer([template.render(c.claim, lm.tokenizer) for c in claims])["input_ids"]
        head = lm.tokenizer(template_head(template, lm.tokenizer))["input_ids"]
        shared = shared_prefix(ids, head)
        if shared < MIN_PREFIX_TOKENS:
            return 0.0
        times = []
        for _ in range(3):
            start = time.perf_counter()
            prefix_states(lm.model, ids[0][:shared], lm.device)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


# -- here ------------------------------------------------------------------------------------
def load_tokenizer(model: str) -> Any:
    """The model's tokenizer, as the loader reads it (no weights)."""
    from transformers import AutoTokenizer

    from dask_pcm.templates.sources import resolve_source

    resolved = resolve_source(model)
    if resolved.kind == "gguf":
        return AutoTokenizer.from_pretrained(
            str(resolved.path.parent), gguf_file=resolved.path.name
        )
    return AutoTokenizer.from_pretrained(str(resolved.path))


def token_counts(
    tokenizer: Any,
    template: PromptTemplate,
    chunks: list[list[Claim]],
    rows_per_pass: int,
    packs: bool,
    by_rows: bool = False,
) -> dict[str, Any]:
    """Tokens per prompt, shared prefix per task and token positions run per claim, with and
    without the prefix, counted as ``LanguageModel.next_token_logits`` runs them: prompts
    sorted by length; whole prompts padded in passes of ``rows_per_pass``; after a kept
    prefix (``packs``: the model packs) laid end to end: with block-local attention
    (``by_rows``) the rows of a pass as one sequence, no padding; else in sequences of up to
    ``PACK_TOKENS``, ``rows_per_pass`` sequences a pass, balanced and padded to the pass's
    longest."""
    head = tokenizer(template_head(template, tokenizer))["input_ids"]
    lengths: list[int] = []
    shared_per_task: list[int] = []
    keys: set[tuple[int, ...]] = set()
    run_without = run_with = 0
    for chunk in chunks:
        ids = tokenizer([template.render(c.claim, tokenizer) for c in chunk])["input_ids"]
        shared = shared_prefix(ids, head)
        shared = shared if shared >= MIN_PREFIX_TOKENS else 0
        shared_per_task.append(shared)
        if shared:
            keys.add(tuple(ids[0][:shared]))
        ordered = sorted(len(i) for i in ids)
        lengths += ordered
        run_without += _padded_positions(ordered, rows_per_pass)
        rest = [n - shared for n in ordered]
        if shared and packs and by_rows:
            run_with += sum(rest)
        elif shared and packs:
            # In passes of rows_per_pass sequences (loaders.passes.in_passes), each pass's
            # rows balanced over as few sequences (loaders.prefix.forward), padded to the
            # pass's longest.
            done = 0
            while done < len(rest):
                take = sum(len(q) for q in pack(rest[done:], PACK_TOKENS)[:rows_per_pass])
                part = rest[done : done + take]
                widths = [sum(part[i] for i in seq) for seq in balanced(part, PACK_TOKENS)]
                run_with += len(widths) * max(widths)
                done += take
        else:
            run_with += _padded_positions(rest, rows_per_pass)
    low, high = min(shared_per_task), max(shared_per_task)
    return {
        "prompt_tokens": statistics.mean(lengths),
        "head_tokens": len(head),
        "prefix_tokens_min": low,
        "prefix_tokens_max": high,
        "prefix": str(low) if low == high else f"{low}-{high}",
        "prefix_keys": len(keys),
        "run_tokens_without": run_without / len(lengths),
        "run_tokens_with": run_with / len(lengths),
        "packed": bool(packs and high),
        "by_rows": bool(packs and by_rows and high),
    }


def _padded_positions(widths: list[int], rows_per_pass: int) -> int:
    """Positions run by passes of ``rows_per_pass`` of ``widths`` (in order), each padded to
    its longest."""
    return sum(
        len(part) * max(part)
        for part in (widths[i : i + rows_per_pass] for i in range(0, len(widths), rows_per_pass))
    )


def _score(
    client: Client, template: PromptTemplate, chunk: list[Claim], prefix: bool, **options: Any
) -> Any:
    """One FEVER task (``score_unit``) as a FEVER run sends it."""
    return dask_pcm.submit(
        client,
        score_unit,
        template,
        chunk,
        "logits",
        CONTEXT,  # score_unit's context; dask_pcm.submit's context= places the task
        context=CONTEXT,
        prefix_cache=prefix,
        pure=False,
        **options,
    )


def run_round(
    client: Client, template: PromptTemplate, chunks: list[list[Claim]], prefix: bool
) -> dict[str, Any]:
    """Score every chunk under ``template`` once; seconds, task seconds and the rows."""
    with get_task_stream(client) as stream, h.Timer() as wall:
        futures = [_score(client, template, chunk, prefix) for chunk in chunks]
        parts = client.gather(futures)
    return {
        "seconds": wall.seconds,
        "task_seconds": _compute_seconds(stream.data),
        "rows": [row for part in parts for row in part],
    }


def warm_up(
    client: Client, template: PromptTemplate, chunks: list[list[Claim]], workers: list[str]
) -> None:
    """Untimed: every chunk with prefix reuse on every worker (fills each worker's prefix
    cache with every prefix the rounds use), then one round without."""
    futures = [
        _score(client, template, chunk, True, workers=[worker])
        for worker in workers
        for chunk in chunks
    ]
    client.gather(futures)
    run_round(client, template, chunks, prefix=False)


def compare(rows: list[dict[str, Any]], expected: list[dict[str, Any]]) -> tuple[int, float]:
    """Changed labels and the largest absolute score difference of ``rows`` from ``expected``."""
    changed, diff = 0, 0.0
    for got, want in zip(rows, expected, strict=True):
        if got["claim_id"] != want["claim_id"]:
            raise RuntimeError(f"rows out of order: {got['claim_id']} != {want['claim_id']}")
        changed += got["predicted"] != want["predicted"]
        for key, value in want.items():
            if key.startswith("score_"):
                diff = max(diff, abs(got[key] - value))
    return changed, diff


def paired(
    name: str,
    n: int,
    run: Callable[[str], dict[str, Any]],
    check: Callable[[Any], None],
    repeats: int,
    seed: int,
) -> dict[str, Any]:
    """``repeats`` pairs of rounds with and without prefix reuse, each pair in a seeded
    random order (``_protocol.schedule``): ``run(mode)`` gives a round's ``seconds``,
    ``task_seconds`` and ``rows``, which ``check`` compares (the first round without
    first); claims/s, their ratio (median and 95 % interval of the pairs) and the pairs."""
    pairs: list[dict[str, Any]] = []
    schedule = P.schedule(MODES, repeats, seed)
    for rep in range(repeats):
        order = [mode for r, mode in schedule if r == rep]
        result = {mode: run(mode) for mode in order}
        for mode in MODES[::-1]:  # the first round without is the reference
            check(result[mode].pop("rows"))
        w, wo = result["with"], result["without"]
        pairs.append(
            {
                "template": name,
                "repeat": rep,
                "first": order[0],
                "seconds_with": w["seconds"],
                "seconds_without": wo["seconds"],
                "task_seconds_with": w["task_seconds"],
                "task_seconds_without": wo["task_seconds"],
                "claims_per_second_with": n / w["seconds"],
                "claims_per_second_without": n / wo["seconds"],
                "ratio": wo["seconds"] / w["seconds"],
                "task_ratio": wo["task_seconds"] / w["task_seconds"],
                "load_average": os.getloadavg()[0],
            }
        )
        p = pairs[-1]
        print(
            f"  {name}, repetition {rep} ({order[0]} first): with {p['seconds_with']:.2f} s, "
            f"without {p['seconds_without']:.2f} s, ratio {p['ratio']:.2f}; load average "
            f"{p['load_average']:.2f}",
            flush=True,
        )
    with_cps = statistics.median(p["claims_per_second_with"] for p in pairs)
    without_cps = statistics.median(p["claims_per_second_without"] for p in pairs)
    ratios = [p["ratio"] for p in pairs]
    spread = P.interval(ratios)  # the 95 % interval of the per-pair ratios (one pair: none)
    loads = [p["load_average"] for p in pairs]
    return {
        "template": name,
        "claims_per_second_with": with_cps,
        "claims_per_second_without": without_cps,
        "ratio": with_cps / without_cps,
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "ratio_low": spread["low"],
        "ratio_high": spread["high"],
        "ratio_range": f"{min(ratios):.2f}-{max(ratios):.2f}",
        "ratios": ratios,
        "task_ratio": statistics.median(p["task_seconds_without"] for p in pairs)
        / statistics.median(p["task_seconds_with"] for p in pairs),
        "load_min": min(loads),
        "load_max": max(loads),
        "pairs": pairs,
    }


def run_template(
    client: Client,
    template: PromptTemplate,
    chunks: list[list[Claim]],
    repeats: int,
    workers: list[str],
    seed: int = 0,
) -> dict[str, Any]:
    """Warm-up, then the :func:`paired` rounds of scoring (method logits); the labels and
    scores of every round against the first round without; the one-time prefix cost."""
    warm_up(client, template, chunks, workers)
    expected: list[dict[str, Any]] = []
    found = {"changed": 0, "diff": 0.0}

    def check(rows: list[dict[str, Any]]) -> None:
        if not expected:
            expected.extend(rows)
        c, d = compare(rows, expected)
        found["changed"] += c
        found["diff"] = max(found["diff"], d)

    def run(mode: str) -> dict[str, Any]:
        return run_round(client, template, chunks, prefix=mode == "with")

    n = sum(len(c) for c in chunks)
    summary = paired(template.name, n, run, check, repeats, seed)
    # The one-time cost: a pass over the prefix, on every worker.
    futures = [
        dask_pcm.submit(
            client,
            prefix_seconds,
            template,
            chunks[0],
            context=CONTEXT,
            workers=[worker],
            pure=False,
        )
        for worker in workers
    ]
    prefix_ms = 1000 * statistics.mean(client.gather(futures))
    return {
        **summary,
        "section": "logits",
        "changed_labels": found["changed"],
        "max_score_diff": found["diff"],
        "prefix_ms": prefix_ms,
    }


def run_generation(
    client: Client,
    template: PromptTemplate,
    chunks: list[list[Claim]],
    repeats: int,
    workers: list[str],
    seed: int = 0,
) -> dict[str, Any]:
    """The generation section: ``GENERATE_TOKENS`` greedy tokens per claim (``generate_task``)
    from the template's kept head and from whole prompts, warmed up as the scoring is, then
    :func:`paired` rounds; whether every round generated the first round's texts."""

    def tasks(prefix: bool, worker: str | None = None) -> list[Any]:
        pinned = {} if worker is None else {"workers": [worker]}
        return [
            dask_pcm.submit(
                client,
                generate_task,
                template,
                chunk,
                prefix,
                context=CONTEXT,
                pure=False,
                **pinned,
            )
            for chunk in chunks
        ]

    client.gather([f for worker in workers for f in tasks(True, worker)])
    client.gather(tasks(False))
    expected: list[str] = []
    changed = [0]

    def check(texts: list[str]) -> None:
        if not expected:
            expected.extend(texts)
        changed[0] += sum(a != b for a, b in zip(texts, expected, strict=True))

    def run(mode: str) -> dict[str, Any]:
        with get_task_stream(client) as stream, h.Timer() as wall:
            parts = client.gather(tasks(mode == "with"))
        return {
            "seconds": wall.seconds,
            "task_seconds": _compute_seconds(stream.data),
            "rows": [t for part in parts for t in part],
        }

    n = sum(len(c) for c in chunks)
    summary = paired(f"{template.name} (generate)", n, run, check, repeats, seed)
    return {
        **summary,
        "section": "generate",
        "template": template.name,
        "new_tokens": GENERATE_TOKENS,
        "changed_texts": changed[0],
        "texts": len(expected),
        "target": GENERATE_TARGET,
        "target_met": summary["ratio"] >= GENERATE_TARGET,
    }


def _compute_seconds(stream: list[dict[str, Any]]) -> float:
    """Seconds the tasks of a task stream spent computing, summed."""
    return sum(
        s["stop"] - s["start"]
        for task in stream
        for s in task["startstops"]
        if s["action"] == "compute"
    )


def _versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for package in ("torch", "transformers", "distributed"):
        try:
            found[f"{package}_version"] = version(package)
        except PackageNotFoundError:
            found[f"{package}_version"] = None
    return found


def _explain(row: dict[str, Any]) -> str:
    """Where the time goes for a template that missed its target."""
    tokens = row["run_tokens_without"] / max(row["run_tokens_with"], 1e-9)
    text = (
        f"  {row['template']}: {row['run_tokens_without']:.1f} token positions run per claim "
        f"without, {row['run_tokens_with']:.1f} with ({tokens:.2f}x fewer); the tasks' "
        f"compute time without / with {row['task_ratio']:.2f}, claims/s with / without "
        f"{row['ratio']:.2f}."
    )
    if tokens < row["target"]:
        text += " Fewer tokens cannot reach the target: too few of a prompt's tokens are shared."
    elif row["task_ratio"] < row["target"]:
        text += (
            " The tasks' compute shrinks less than the tokens: costs per pass and per task "
            "that do not scale with the tokens run."
        )
    else:
        text += " The tasks' compute meets it: the rest is the rounds' overhead and tail."
    return text


def main() -> None:
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    p = h.parser(__doc__.split("\n\n")[0])
    p.add_argument("--claims", type=int, help="claims per round (default 128, --quick 32)")
    p.add_argument(
        "--claims-per-task",
        type=int,
        default=CLAIMS_PER_TASK,
        help=f"claims per task (default {CLAIMS_PER_TASK}, run_fever's)",
    )
    p.add_argument(
        "--templates",
        help=f"comma-separated built-in templates (default all; --quick {QUICK_TEMPLATES})",
    )
    p.add_argument(
        "--no-generate",
        action="store_true",
        help=f"leave out the generation section ({GENERATE_TEMPLATE}, {GENERATE_TOKENS} tokens)",
    )
    args = p.parse_args()
    repeats = P.repetitions(args.quick, args.repetitions)
    n = args.claims or (32 if args.quick else 128)
    spec = args.templates or (QUICK_TEMPLATES if args.quick else None)
    templates = get_templates(spec)

    model = h.model_path(args)
    claims = h.load_claims(args.data, n)
    chunks = h.batches(claims, args.claims_per_task)
    tokenizer = load_tokenizer(model)
    print(
        f"{n} claims in {len(chunks)} tasks of {args.claims_per_task}, {len(templates)} "
        f"templates, {repeats} repetitions, {args.workers} workers x 1 thread, model "
        f"{model}; load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )

    rows: list[dict[str, Any]] = []
    with h.Timer() as total, h.warm_cluster(model, args.workers) as client:
        dask_pcm.register(client, dask_pcm.causal_lm(model, name=CONTEXT), level="full")
        workers = list(client.scheduler_info()["workers"])
        info = client.gather(
            [
                dask_pcm.submit(client, worker_model, context=CONTEXT, workers=[w], pure=False)
                for w in workers
            ]
        )
        if any(i["prefix_cache_limit"] is None for i in info):
            sys.exit("pcm.worker.prefix-cache is off on the workers: nothing to measure")
        rows_per_pass, packs = info[0]["batch_size"], info[0]["packable"]
        by_rows = info[0]["by_rows"]
        for template in templates:
            counts = token_counts(tokenizer, template, chunks, rows_per_pass, packs, by_rows)
            rows.append(
                {**counts, **run_template(client, template, chunks, repeats, workers, args.seed)}
            )
        generation = None
        if not args.no_generate:
            (chosen,) = get_templates(GENERATE_TEMPLATE)
            generation = run_generation(client, chosen, chunks, repeats, workers, args.seed)
        after = client.gather(
            [
                dask_pcm.submit(client, worker_model, context=CONTEXT, workers=[w], pure=False)
                for w in workers
            ]
        )
        loads = int(dask_pcm.status(client, [CONTEXT])["loads"].sum())
    if loads != len(workers):
        raise RuntimeError(f"the resident model was loaded {loads} times, not once per worker")

    run = uuid.uuid4().hex[:8]  # one id for the rows of one invocation
    settings = {
        "run": run,
        "started": started,
        "claims": n,
        "claims_per_task": args.claims_per_task,
        "repeats": repeats,
        "workers": args.workers,
        "rows_per_pass": rows_per_pass,
        "model": model,
        **_versions(),
    }
    for row in rows:
        target, low = TARGETS.get(row["template"]), TARGET_LOW.get(row["template"])
        # The speed-up if a position ran as fast with reuse as without, and how close to it.
        row["bound"] = row["run_tokens_without"] / row["run_tokens_with"]
        row["positions_per_second_with"] = row["run_tokens_with"] * row["claims_per_second_with"]
        row["positions_per_second_without"] = (
            row["run_tokens_without"] * row["claims_per_second_without"]
        )
        row["rate_ratio"] = row["positions_per_second_with"] / row["positions_per_second_without"]
        row["rate_target"] = RATE_TARGET if row["prefix_tokens_max"] else None
        row["target"], row["target_low"] = target, low
        row["target_met"] = (
            None
            if target is None
            else row["ratio"] >= target and (low is None or row["ratio_low"] >= low)
        )
        goal = (
            "-"
            if target is None
            else f">={target:g}" + ("" if low is None else f" (low >={low:g})")
        )
        row["target_text"] = (
            goal if target is None else f"{goal} {'met' if row['target_met'] else 'MISSED'}"
        )
        row["same_text"] = "yes" if row["changed_labels"] == 0 else f"NO ({row['changed_labels']})"
        row.update(settings)
    if generation is not None:
        generation.update(settings)
        rows.append(generation)
    scoring = [row for row in rows if row["section"] == "logits"]
    print()
    h.print_table(scoring, COLUMNS)
    print()
    h.print_table([pair for row in rows for pair in row["pairs"]], PAIR_COLUMNS)
    print()
    for row in scoring:
        if row["target"] is not None:
            print(
                f"target {row['template']}: {row['ratio']:.2f}x (95 % interval "
                f"{row['ratio_low']:.2f}-{row['ratio_high']:.2f}) against {row['target_text']}"
            )
    for row in scoring:
        if row["rate_target"] is not None:
            print(
                f"positions/s {row['template']}: {row['positions_per_second_with']:.0f} with, "
                f"{row['positions_per_second_without']:.0f} without: {row['rate_ratio']:.2f} "
                f"(goal >= {RATE_TARGET:g}), bound {row['bound']:.2f}x"
            )
    if generation is not None:
        g = generation
        print(
            f"generation ({g['template']}, {g['new_tokens']} tokens): with "
            f"{g['claims_per_second_with']:.2f} claims/s, without "
            f"{g['claims_per_second_without']:.2f}: {g['ratio']:.2f}x (95 % interval "
            f"{g['ratio_low']:.2f}-{g['ratio_high']:.2f}) against >= {GENERATE_TARGET:g}: "
            f"{'met' if g['target_met'] else 'MISSED'}; texts "
            + ("identical" if not g["changed_texts"] else f"CHANGED: {g['changed_texts']}")
        )
    print(
        "load average (1 min) at the pairs' ends: "
        f"{min(r['load_min'] for r in rows):.2f}-{max(r['load_max'] for r in rows):.2f}"
    )
    missed = [row for row in scoring if row["target_met"] is False]
    if missed:
        print("where the time goes:")
        for row in missed:
            print(_explain(row))
    print(
        "prefix cache per worker at the end: "
        + ", ".join(
            f"{i['prefix_entries']} entries, {i['prefix_cache_bytes'] / 1e6:.1f} MB" for i in after
        )
        + f"; {total.seconds:.0f} s in all"
    )
    changed = {r["template"]: r["changed_labels"] for r in scoring if r["changed_labels"]}
    if generation is not None and generation["changed_texts"]:
        changed[f"{GENERATE_TEMPLATE} (generated texts)"] = generation["changed_texts"]
    if not changed:
        print(f"identical predictions with and without prefix reuse in all {len(rows)} rows")
    h.write_json(args.json, rows, reps=repeats, seed=args.seed)
    plot = [
        {
            "template": row["template"],
            "mode": f"{mode} prefix reuse",
            "claims_per_second": row[f"claims_per_second_{mode}"],
        }
        for row in scoring
        for mode in MODES[::-1]
    ]
    h.plot_bars(
        args.json,
        plot,
        "template",
        "claims_per_second",
        group="mode",
        title=f"{n} FEVER claims per round, tasks of {args.claims_per_task}, {args.workers} "
        f"workers, median of {repeats}",
        ylabel="claims/s (higher is better)",
    )
    if changed:
        sys.exit(f"predictions differ with prefix reuse: changed per template {changed}")


if __name__ == "__main__":
    main()
