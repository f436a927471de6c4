"""GPU smoke test: does a model context really run as it should on an NVIDIA GPU?

Six checks, one line each (``PASS``, ``FAIL`` or ``SKIP`` and the figures); all figures also
go to a JSON file, and the exit status is 1 when a check failed. Under five minutes on one GPU
with the embedded SmolLM2-135M-Instruct.

1. ``weights``: ``CausalLM()`` puts the weights on CUDA, in the dtype
   :func:`dask_pcm.engine.gpu.dtype_for` picks for the GPU's compute capability.
2. ``logits``: next-token logits of a few factual prompts are finite and have the same argmax
   as the model in float32 on the CPU (bfloat16 may flip one near-tie).
3. ``peak-memory``: the allocator's peak for scoring and for generation at the chosen batch
   size stays under the estimate the batch was sized by (``prompt_bytes``, meant to err large).
4. ``release``: releasing a loaded model, and unregistering a context on a local cluster,
   gives the device memory back.
5. ``fever``: ``run_fever`` on a local cluster of one worker per GPU (at most two), one claim
   per task, predicts the same labels as the same claims scored in this process.
6. ``oversized-batch``: a batch far too large for the device either runs or halves itself
   until it does, and leaves no device memory behind.

Run it from the repository root on a machine with a GPU::

    python tools/gpu_smoke.py --json gpu-smoke.json

``--allow-cpu`` runs it without a GPU, to test the script itself (``tests/benchmarks/test_gpu_smoke.py``):
the checks that need CUDA say ``SKIP (no GPU)`` and check 5 runs on two CPU workers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from distributed import Client

import dask_pcm
from dask_pcm.apps.fever import demo_claims, get_templates, load_claims
from dask_pcm.apps.fever.scoring import score_logits
from dask_pcm.engine.gpu import dtype_for, prompt_bytes
from dask_pcm.engine.model import TOKENS_PER_PROMPT

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO.parent / "shared" / "data" / "fever" / "paper_dev.jsonl"
MIB = 2**20

FACTS = (
    "The capital of France is",
    "Water is made of hydrogen and",
    "The largest planet in the solar system is",
    "The chemical symbol for gold is",
    "Two plus two equals",
    "The first president of the United States was George",
    "The Great Wall is in",
    "The opposite of hot is",
    "A week has seven",
    "The Pacific is the largest",
)
# A short built-in template: the prompts are cheap, so the FEVER check times the cluster.
FEVER_TEMPLATE = "direct"
GENERATE_TOKENS = 8
# Far beyond what a batch of a small model needs: out of memory on most GPUs.
OVERSIZED_ROWS = 4096
OVERSIZED_TOKENS = 2048


@dataclass
class Check:
    """One check's outcome: ``PASS`` until an expectation fails or the check is skipped."""

    name: str
    status: str = "PASS"
    notes: list[str] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)

    def expect(self, condition: bool, failure: str) -> None:
        if not condition:
            self.fail(failure)

    def fail(self, why: str) -> None:
        self.status = "FAIL"
        self.notes.append(why)

    def line(self) -> str:
        shown = " ".join(f"{key}={_show(key, value)}" for key, value in self.figures.items())
        notes = f" ({'; '.join(self.notes)})" if self.notes else ""
        return f"{self.status:<4} {self.name}: {shown}{notes}"

    def as_json(self) -> dict[str, Any]:
        return {"status": self.status, "notes": self.notes, **self.figures}


def _show(key: str, value: Any) -> str:
    if key.endswith("bytes") and isinstance(value, list):
        return f"[{', '.join(_show(key, v) for v in value)}]"
    if key.endswith("bytes") and isinstance(value, int):
        return f"{value / MIB:.1f}MiB"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


@dataclass
class Smoke:
    """What the checks share: the model under test and how to treat a missing GPU."""

    model: str | None
    allow_cpu: bool
    lm: Any

    @property
    def on_gpu(self) -> bool:
        return bool(self.lm.device.startswith("cuda"))

    def no_gpu(self, check: Check, what: str = "no GPU") -> None:
        # A GPU that torch sees but the model does not use is a failure even with --allow-cpu.
        check.status = "SKIP" if self.allow_cpu and not torch.cuda.is_available() else "FAIL"
        check.notes.append(what if not self.lm.warning else f"{what}: {self.lm.warning}")


def check_weights(check: Check, smoke: Smoke) -> None:
    lm = smoke.lm
    check.figures.update(
        device=lm.device,
        dtype=lm.dtype,
        batch_size=lm.batch_size,
        memory_budget_bytes=lm.memory_budget,
        nbytes=lm.nbytes,
    )
    if not smoke.on_gpu:
        smoke.no_gpu(check)
        return
    major, minor = torch.cuda.get_device_capability(lm.device)
    capability = (int(major), int(minor))
    check.figures.update(gpu=torch.cuda.get_device_name(lm.device), capability=f"{major}.{minor}")
    params = list(lm.model.parameters())
    check.expect(all(p.device.type == "cuda" for p in params), "parameters not all on CUDA")
    want = getattr(torch, lm.dtype)
    check.expect(all(p.dtype == want for p in params), f"parameters not all {lm.dtype}")
    expected = dtype_for(capability)
    check.expect(lm.dtype == expected, f"dtype_for({capability}) is {expected}")


def check_logits(check: Check, smoke: Smoke) -> None:
    logits = smoke.lm.next_token_logits(FACTS)
    check.expect(bool(torch.isfinite(logits).all()), "logits not all finite")
    loader = dask_pcm.CausalLM(device="cpu", dtype="float32")
    reference = loader(smoke.model)
    try:
        expected = reference.next_token_logits(FACTS)
    finally:
        loader.release(reference)
    agree = int((logits.argmax(-1) == expected.argmax(-1)).sum())
    difference = (logits.log_softmax(-1) - expected.log_softmax(-1)).abs().max().item()
    # bfloat16 keeps 8 bits of mantissa: two top tokens within ~1 % of each other may swap.
    allowed = 1 if smoke.lm.dtype == "bfloat16" else 0
    check.figures.update(
        dtype=smoke.lm.dtype,
        prompts=len(FACTS),
        argmax_agree=agree,
        max_abs_logsoftmax_diff=difference,
    )
    if allowed:
        check.notes.append(f"bfloat16: {allowed} argmax disagreement of {len(FACTS)} allowed")
    check.expect(len(FACTS) - agree <= allowed, "argmax differs from the CPU in float32")


def check_peak_memory(check: Check, smoke: Smoke) -> None:
    if not smoke.on_gpu:
        smoke.no_gpu(check)
        return
    lm = smoke.lm
    prompt = " ".join(["yes"] * (TOKENS_PER_PROMPT - 2))
    prompts = [prompt] * lm.batch_size
    tokens = len(lm.tokenizer(prompt)["input_ids"])
    element = next(lm.model.parameters()).element_size()
    check.figures.update(batch_size=lm.batch_size, tokens=tokens)
    passes: list[tuple[str, int, Callable[[list[str]], Any]]] = [
        ("logits", 0, lm.next_token_logits),
        ("generate", GENERATE_TOKENS, partial(lm.generate, max_new_tokens=GENERATE_TOKENS)),
    ]
    for method, new_tokens, run in passes:
        rows = lm.rows_per_pass(prompts, method, new_tokens)
        estimate = rows * prompt_bytes(lm.model.config, element, tokens, method, new_tokens)
        torch.cuda.reset_peak_memory_stats(lm.device)
        baseline = torch.cuda.memory_allocated(lm.device)
        run(prompts)
        peak = torch.cuda.max_memory_allocated(lm.device) - baseline
        check.figures.update(
            {
                f"{method}_rows": rows,
                f"{method}_peak_bytes": peak,
                f"{method}_estimate_bytes": estimate,
                f"{method}_ratio": peak / estimate,
            }
        )
        check.expect(peak <= estimate, f"{method} peak above the estimate")


def cuda_allocated(device: str | None = None) -> int:
    """The CUDA allocator's bytes in use, cuBLAS workspaces left out; 0 where CUDA was never
    initialised (also on workers, through ``client.run``)."""
    if not torch.cuda.is_initialized():
        return 0
    # cuBLAS keeps a workspace per handle and stream for the life of the process (MiBs,
    # counted as allocated): a cost of having run a matmul, not memory a model holds on to.
    # PyTorch's own leak checks clear them the same way before they measure.
    torch._C._cuda_clearCublasWorkspaces()
    return int(torch.cuda.memory_allocated(device))


def visible_devices() -> str | None:
    """On a worker: the GPUs its nanny gave it."""
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def check_release(check: Check, smoke: Smoke, client: Client) -> None:
    if smoke.on_gpu:
        loader = dask_pcm.CausalLM()
        unloaded = cuda_allocated()
        loader.release(loader(smoke.model))
        released = cuda_allocated()
        check.figures.update(release_before_bytes=unloaded, release_after_bytes=released)
        check.expect(released - unloaded <= MIB, "release left memory allocated")
    workers = sorted(client.scheduler_info()["workers"])
    before_by_worker = client.run(cuda_allocated)
    context = dask_pcm.Context("smoke", dask_pcm.CausalLM(), template=smoke.model)
    dask_pcm.register(client, context)
    loaded_by_worker = client.run(cuda_allocated)
    dask_pcm.unregister(client, "smoke")
    after_by_worker = client.run(cuda_allocated)
    before = [before_by_worker[w] for w in workers]
    loaded = [loaded_by_worker[w] for w in workers]
    after = [after_by_worker[w] for w in workers]
    check.figures.update(
        workers=len(workers),
        worker_before_bytes=before,
        worker_loaded_bytes=loaded,
        worker_after_bytes=after,
    )
    if not smoke.on_gpu:
        smoke.no_gpu(check, "no GPU: registered and unregistered, no allocator to compare")
        return
    check.expect(all(x > b for x, b in zip(loaded, before, strict=True)), "a worker off CUDA")
    check.expect(
        all(a - b <= MIB for a, b in zip(after, before, strict=True)),
        "unregister left memory allocated on a worker",
    )


def check_fever(check: Check, smoke: Smoke, client: Client, data: Path | None, limit: int) -> None:
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as output:
        result = dask_pcm.run_fever(
            data=data,
            model=smoke.model,
            templates=[FEVER_TEMPLATE],
            cluster=client,
            claims_per_task=1,
            limit=limit,
            progress=False,
            output=output,
        )
        predictions = result.predictions  # read from the folder, before it goes
    cluster_seconds = time.perf_counter() - start
    claims = {c.id: c for c in (demo_claims() if data is None else load_claims(data)).claims}
    expected = min(limit, len(claims))
    if data is None:
        check.notes.append(f"no FEVER file: the {len(claims)} built-in demo claims")
    devices = client.run(visible_devices)

    # The one-process reference: the claims run_fever scored, prompted as its tasks prompt.
    template = get_templates(FEVER_TEMPLATE)[0]
    lm = smoke.lm
    prompts = [template.render(claims[i].claim, lm.tokenizer) for i in predictions["claim_id"]]
    reference = [row["predicted"] for row in score_logits(lm, prompts, template.answers)]
    agree = sum(a == b for a, b in zip(predictions["predicted"], reference, strict=True))
    compared = len(reference)
    check.figures.update(
        tasks=result.report["units"]["total"],
        compared=compared,
        agree=agree,
        agreement=agree / compared if compared else 0.0,
        accuracy=float(result.summary["accuracy"].iloc[0]),
        cluster_seconds=cluster_seconds,
        visible_devices=sorted(map(str, devices.values())),
    )
    check.expect(compared == expected, f"{expected} claims expected")
    check.expect(result.report["units"]["total"] == expected, "not one task per claim")
    check.expect(compared > 0 and agree >= 0.99 * compared, "under 99 % agreement")
    if smoke.on_gpu and len(devices) > 1:
        check.expect(len(set(devices.values())) == len(devices), "workers share a GPU")


def check_oversized_batch(check: Check, smoke: Smoke) -> None:
    if not smoke.on_gpu:
        smoke.no_gpu(check)
        return
    lm = smoke.lm
    before = cuda_allocated(lm.device)
    # Forced: no budget to shrink the pass beforehand, so only the out-of-memory path can.
    lm.batch_size, lm.memory_budget = OVERSIZED_ROWS, None
    lm.next_token_logits([" ".join(["yes"] * OVERSIZED_TOKENS)] * OVERSIZED_ROWS)
    after = cuda_allocated(lm.device)
    free, total = torch.cuda.mem_get_info(lm.device)
    check.figures.update(
        rows=OVERSIZED_ROWS,
        tokens=OVERSIZED_TOKENS,
        rows_per_pass=lm.batch_size,
        weights_bytes=sum(p.numel() * p.element_size() for p in lm.model.parameters()),
        before_bytes=before,
        after_bytes=after,
        free_bytes=int(free),
        total_bytes=int(total),
    )
    if lm.batch_size == OVERSIZED_ROWS:
        check.notes.append(f"did not run out of memory at {OVERSIZED_ROWS} rows")
    # The level before the call already holds the weights: nothing beyond it may stay.
    check.expect(after - before <= MIB, "memory left allocated after the call")


def run_check(checks: list[Check], name: str, body: Callable[..., None], *args: Any) -> None:
    check = Check(name)
    start = time.perf_counter()
    try:
        body(check, *args)
    except Exception as exc:  # a broken check is a failure to report, not the end of the run
        check.fail(f"{type(exc).__name__}: {exc}")
    check.figures["seconds"] = round(time.perf_counter() - start, 2)
    print(check.line(), flush=True)
    checks.append(check)


@contextmanager
def cluster_client(workers: int) -> Iterator[Client]:
    with (
        dask_pcm.local_cluster(n_workers=workers, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        client.wait_for_workers(workers)
        yield client


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model",
        help="model directory, .gguf file or hub id (default: the embedded SmolLM2-135M)",
    )
    parser.add_argument(
        "--data",
        type=Path,
        help=f"FEVER JSON lines (default: {DEFAULT_DATA} if present, else the demo claims)",
    )
    parser.add_argument("--limit", type=int, default=500, help="FEVER claims (default 500)")
    parser.add_argument(
        "--json",
        type=Path,
        default=Path("gpu-smoke.json"),
        help="where to write the figures (default gpu-smoke.json)",
    )
    parser.add_argument(
        "--allow-cpu",
        action="store_true",
        help="without a GPU, skip the checks that need CUDA instead of failing them",
    )
    args = parser.parse_args(argv)
    if args.data is None and DEFAULT_DATA.is_file():
        args.data = DEFAULT_DATA
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    smoke = Smoke(args.model, args.allow_cpu, dask_pcm.CausalLM()(args.model))
    checks: list[Check] = []
    run_check(checks, "weights", check_weights, smoke)
    run_check(checks, "logits", check_logits, smoke)
    run_check(checks, "peak-memory", check_peak_memory, smoke)
    workers = min(2, torch.cuda.device_count()) if smoke.on_gpu else 2
    with cluster_client(workers) as client:
        run_check(checks, "release", check_release, smoke, client)
        run_check(checks, "fever", check_fever, smoke, client, args.data, args.limit)
    # Last: it leaves the model with whatever batch size the out-of-memory path settled on.
    run_check(checks, "oversized-batch", check_oversized_batch, smoke)
    passed = all(c.status != "FAIL" for c in checks)
    report = {
        "passed": passed,
        "seconds": round(time.perf_counter() - start, 1),
        "model": args.model or "embedded",
        "data": str(args.data) if args.data else None,
        "limit": args.limit,
        "checks": {c.name: c.as_json() for c in checks},
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'PASS' if passed else 'FAIL'} in {report['seconds']} s; figures in {args.json}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
