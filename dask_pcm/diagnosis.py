"""``dask-pcm doctor``: what each worker's hardware and torch make of a context.

Per worker: the device it would use and why, compute capability, dtype, free memory, driver
and CUDA runtime versions, the batch size it chooses, one forward pass compared with a
CPU float32 pass of the same model (same most likely next token on a few prompts), and the
dask_pcm worker setup it has (:func:`dask_pcm.deploy.worker_setup.worker_settings`). Where
something is off (a GPU torch cannot use, two workers on one GPU, answers that differ from
float32, room for one prompt only, a worker started without the setup) it says what to do.
On a CPU-only machine it says that plainly.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from dask_pcm.deploy.worker_setup import MALLOC_TRIM, PREIMPORT, worker_settings
from dask_pcm.engine.gpu import plan_device
from dask_pcm.engine.llm import CausalLM
from dask_pcm.gpus import VISIBLE, driver_version, installed_gpus
from dask_pcm.worker.device import cpu_model

#: Prompts of the comparison with CPU float32: the next token of each must agree.
PROMPTS = (
    "The capital of France is",
    "Water is made of hydrogen and",
    "A spider has eight",
    "The largest planet of the solar system is",
    "Romeo and Juliet was written by William",
    "Claim: The Eiffel Tower is in Berlin. Is the claim true? Answer:",
)


@dataclass
class WorkerReport:
    """What ``doctor`` found on one worker; ``advice`` says what to change, if anything."""

    worker: str
    host: str = ""
    torch: str | None = None
    cuda_runtime: str | None = None
    driver: str | None = None
    gpus_on_host: int = 0
    cpu: str | None = None
    visible_devices: str | None = None
    device: str | None = None
    gpu: str | None = None
    capability: str | None = None
    dtype: str | None = None
    total_memory: int | None = None
    free_memory: int | None = None
    batch_size: int | None = None
    load_seconds: float | None = None
    agreement: str | None = None
    setup: dict[str, Any] | None = None
    advice: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and not self.advice


def examine(
    model: str | None = None, device: str = "auto", dtype: str = "auto", compare: bool = True
) -> WorkerReport:
    """Examine this process (a worker's, or the client's own): see the module docstring."""
    report = WorkerReport(
        worker="",
        host=socket.gethostname(),
        driver=driver_version(),
        gpus_on_host=installed_gpus(),
        visible_devices=os.environ.get(VISIBLE),
    )
    try:
        import torch
    except ImportError as exc:
        report.error = f"torch cannot be imported: {exc}"
        return report
    report.torch, report.cuda_runtime = torch.__version__, torch.version.cuda
    report.cpu = f"{torch.get_num_threads()} torch threads, {cpu_model()}"
    try:
        plan = plan_device(torch, device, dtype)
    except Exception as exc:
        report.error = f"choosing the device failed: {type(exc).__name__}: {exc}"
        return report
    report.device, report.dtype, report.gpu = plan.device, plan.dtype, plan.gpu
    if plan.warning:
        report.advice.append(plan.warning)
    if plan.capability is not None:
        report.capability = f"{plan.capability[0]}.{plan.capability[1]}"
        report.free_memory, report.total_memory = (
            int(n) for n in torch.cuda.mem_get_info(torch.device(plan.device))
        )
        if plan.capability < (7, 0) and dtype == "auto":
            report.advice.append(
                f"compute capability {report.capability}: float32 is used (float16 is slow "
                "and bfloat16 emulated on these cards); newer GPUs run 2-4x faster in 16 bits"
            )
    _load_and_compare(report, model, plan.device, plan.dtype, compare)
    return report


def _load_and_compare(
    report: WorkerReport, model: str | None, device: str, dtype: str, compare: bool
) -> None:
    loader = CausalLM(device=device, dtype=dtype)
    start = time.perf_counter()
    try:
        lm = loader(model)
    except Exception as exc:
        report.error = f"{type(exc).__name__}: {exc}"
        return
    report.load_seconds = round(time.perf_counter() - start, 2)
    report.batch_size = lm.batch_size
    try:
        if lm.batch_size == 1 and device.startswith("cuda"):
            report.advice.append(
                f"only one prompt per pass fits in {report.free_memory or 0:,} free bytes on "
                f"{device}: another process may hold this GPU (nvidia-smi), or the model is "
                "too large for it"
            )
        if not compare:
            return
        if device == "cpu" and dtype == "float32":
            report.agreement = "the context runs as CPU float32 itself"
            return
        _compare_with_cpu(report, lm, model)
    finally:
        loader.release(lm)


def _compare_with_cpu(report: WorkerReport, lm: Any, model: str | None) -> None:
    import torch

    reference_loader = CausalLM(device="cpu", dtype="float32")
    reference = reference_loader(model)
    try:
        here = torch.log_softmax(lm.next_token_logits(list(PROMPTS)), dim=-1)
        there = torch.log_softmax(reference.next_token_logits(list(PROMPTS)), dim=-1)
    finally:
        reference_loader.release(reference)
    same = int((here.argmax(-1) == there.argmax(-1)).sum())
    if not bool(torch.isfinite(here).all()):
        report.advice.append(f"{lm.device} in {lm.dtype} gives non-finite logits: use float32")
    difference = float((here - there).abs().max())
    report.agreement = (
        f"{same}/{len(PROMPTS)} next tokens as CPU float32; max |log p difference| {difference:.3g}"
    )
    if same < len(PROMPTS):
        report.advice.append(
            f"{len(PROMPTS) - same} of {len(PROMPTS)} next tokens differ from CPU float32 in "
            f"{lm.dtype} on {lm.device}: check the results, or load with dtype='float32'"
        )


async def _examine_on_worker(
    model: str | None, device: str, dtype: str, compare: bool, dask_worker: Any = None
) -> dict[str, Any]:
    from dask_pcm.worker import preimport

    # A thread, not the event loop: a load takes seconds, and the worker must keep
    # heartbeating meanwhile. First the worker's preimport of torch and transformers, if one
    # runs: two threads importing transformers at once fail.
    await asyncio.to_thread(preimport.wait)
    report = await asyncio.to_thread(examine, model, device, dtype, compare)
    report.worker = dask_worker.address
    report.setup = worker_settings(dask_worker)
    report.advice += setup_advice(report.setup)
    return asdict(report)


def setup_advice(setup: dict[str, Any]) -> list[str]:
    """Advice for a worker whose settings (:func:`worker_settings`) say it was started
    without the dask_pcm worker setup."""
    if setup.get(MALLOC_TRIM) is None and PREIMPORT in (setup.get("preloads") or []):
        return []
    return [
        f"this worker was started without the dask_pcm worker setup ({MALLOC_TRIM}="
        f"{setup.get(MALLOC_TRIM)}, preloads {setup.get('preloads')}): CPU inference runs "
        "slower and torch is imported only when the first context arrives; start workers "
        "with `dask-pcm worker` or dask_pcm.local_cluster"
    ]


def doctor(
    client: Any,
    model: str | None = None,
    device: str = "auto",
    dtype: str = "auto",
    compare: bool = True,
) -> list[WorkerReport]:
    """Examine every worker of ``client`` (see the module docstring), at once.

    Parameters
    ----------
    client
        A :class:`distributed.Client` with at least one worker.
    model
        What to load (a directory, ``.gguf`` file or hub id); default the embedded model.
    device, dtype
        As for :class:`dask_pcm.CausalLM`.
    compare
        Also load the model as CPU float32 and compare one forward pass.

    Example
    -------
    >>> for report in dask_pcm.doctor(client):  # doctest: +SKIP
    ...     print(report.worker, report.device, report.dtype, report.advice)
    """
    if not client.scheduler_info().get("workers"):
        raise ValueError("doctor: the cluster has no workers yet (scale it up first)")
    results = client.run(_examine_on_worker, model, device, dtype, compare, on_error="return")
    reports = []
    for worker, found in sorted(results.items()):
        if isinstance(found, BaseException):
            reports.append(WorkerReport(worker, error=f"no answer: {found!r}"))
        else:
            reports.append(WorkerReport(**found))
    _shared_gpus(reports)
    return reports


def _shared_gpus(reports: list[WorkerReport]) -> None:
    """Advise where workers of one host use the same GPU."""
    users: dict[tuple[str, str, str], list[WorkerReport]] = {}
    for r in reports:
        if r.device and r.device.startswith("cuda"):
            key = (r.host, r.visible_devices or "all", r.device)
            users.setdefault(key, []).append(r)
    for (host, visible, device), sharing in users.items():
        if len(sharing) > 1:
            for r in sharing:
                r.advice.append(
                    f"{len(sharing)} workers on {host} use {device} with CUDA_VISIBLE_DEVICES="
                    f"{visible}: start them with dask_pcm.local_cluster or "
                    "`dask-pcm worker` for one GPU each"
                )


def format_reports(reports: list[WorkerReport]) -> str:
    """The reports as text, one block per worker."""
    blocks = []
    for r in reports:
        lines = [f"{r.worker} on {r.host or '?'}"]
        if r.torch is not None:
            lines.append(
                f"  torch {r.torch}, CUDA runtime {r.cuda_runtime or 'none (CPU build)'}, "
                f"driver {r.driver or 'none'}; GPUs on host {r.gpus_on_host}, "
                f"CUDA_VISIBLE_DEVICES={r.visible_devices if r.visible_devices is not None else 'unset'}"
            )
        if r.setup is not None:
            lines.append(f"  worker setup: {_setup_line(r.setup)}")
        if r.device is not None:
            where = r.device
            if r.gpu:
                where += f" ({r.gpu}, compute capability {r.capability})"
            lines.append(f"  device {where}, dtype {r.dtype}")
        if r.total_memory:
            lines.append(
                f"  memory {(r.free_memory or 0) / 2**30:.1f} GiB free of "
                f"{r.total_memory / 2**30:.1f} GiB"
            )
        if r.batch_size is not None:
            lines.append(f"  batch {r.batch_size} prompts per pass; loaded in {r.load_seconds} s")
        if r.device == "cpu" and not r.gpus_on_host and r.error is None:
            lines.append(
                f"  no GPU on this worker: the context runs on the CPU ({r.cpu}) in "
                f"{r.dtype}, {r.batch_size} prompts per pass"
            )
        if r.agreement:
            lines.append(f"  check: {r.agreement}")
        if r.error:
            lines.append(f"  ERROR: {r.error}")
        lines += [f"  ADVICE: {a}" for a in r.advice]
        if r.ok:
            lines.append("  OK")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def _setup_line(setup: dict[str, Any]) -> str:
    trim = setup.get(MALLOC_TRIM)
    return (
        f"tick {setup.get('tick-interval')} s, profile {setup.get('profile-interval')} s, "
        f"{MALLOC_TRIM} {'unset' if trim is None else trim}, "
        f"preloads {', '.join(setup.get('preloads') or []) or 'none'}"
    )
