"""The ready-made loader for causal language models.

:class:`CausalLM` is a small, picklable loader: Dask ships it to every worker, where calling it
with a model location builds a :class:`LanguageModel` (model and tokenizer on the worker's
device). torch and transformers are imported only there, so ``import dask_pcm`` stays fast.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from dask_pcm import config, locks
from dask_pcm.engine.gpu import (
    BATCH_MEMORY_FRACTION,
    DTYPES,
    DevicePlan,
    free_cached_memory,
    plan_device,
    prompt_bytes,
    rows_that_fit,
)
from dask_pcm.engine.model import (
    CPU_BATCH_SIZE,
    CPU_GENERATE_BATCH_SIZE,
    TOKENS_PER_PROMPT,
    LanguageModel,
    building_for_one_task,
)
from dask_pcm.engine.prefix import PrefixCache
from dask_pcm.exceptions import ContextLoadError, ModelSourceError
from dask_pcm.templates.sources import (
    EMBEDDED,
    ResolvedSource,
    model_files,
    resolve_source,
    template_files,
)
from dask_pcm.templates.tree import TemplateFiles

__all__ = [
    "CPU_BATCH_SIZE",
    "CPU_GENERATE_BATCH_SIZE",
    "TOKENS_PER_PROMPT",
    "CausalLM",
    "LanguageModel",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CausalLM:
    """Loader of causal language models: ``CausalLM()(location)`` gives a :class:`LanguageModel`.

    Small and picklable (only the three options travel); equal options mean equal loaders, also
    for Dask's tokenizer. The heavy imports and the load happen when it is called.

    Parameters
    ----------
    device
        ``"auto"``: the worker's CUDA device when this torch can use it, else the CPU (with a
        warning in the context's status when a GPU is there but unusable); or a torch device
        string such as ``"cpu"`` or ``"cuda:1"``.
    dtype
        ``"auto"``: by the device's compute capability, bfloat16 from 8.0, float16 at 7.x,
        float32 below and on the CPU (:func:`dask_pcm.engine.gpu.dtype_for`); or
        ``"float32"``, ``"float16"``, ``"bfloat16"``.
    batch_size
        Most prompts per forward pass. ``None`` chooses per worker when the model loads:
        :data:`CPU_BATCH_SIZE` on a CPU (:data:`CPU_GENERATE_BATCH_SIZE` when generating);
        on a GPU, as many prompts of :data:`TOKENS_PER_PROMPT` tokens as 70 % of the free
        device memory holds (a power of two, at most 256), tried by the warm-up pass. Either
        way an out-of-memory error halves it.

    Example
    -------
    >>> loader = CausalLM(device="cpu")
    >>> loader
    CausalLM(device='cpu', dtype='auto', batch_size=None)
    >>> lm = loader("HuggingFaceTB/SmolLM2-135M-Instruct")  # doctest: +SKIP
    """

    device: str = "auto"
    dtype: str = "auto"
    batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.batch_size is not None and (
            not isinstance(self.batch_size, int) or self.batch_size < 1
        ):
            raise ValueError(f"batch_size must be a positive integer, got {self.batch_size!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}: use one of {', '.join(DTYPES)}")
        if not isinstance(self.device, str) or not self.device:
            raise ValueError(f"device must be a non-empty string, got {self.device!r}")

    def __dask_tokenize__(self) -> tuple[str, str, str, int | None]:
        return (type(self).__qualname__, self.device, self.dtype, self.batch_size)

    def __call__(self, location: str | os.PathLike[str] | None) -> LanguageModel:
        """Load the model at ``location`` (anything :func:`dask_pcm.templates.sources.resolve_source`
        takes); ``None`` loads the embedded SmolLM2-135M-Instruct, this loader's default.

        Raises
        ------
        ModelSourceError
            The location cannot be used (missing, wrong format, hub offline).
        ContextLoadError
            Loading failed, batch sizing or the warm-up pass included (then whatever was
            loaded is freed); the message names the model path and the original error.
        """
        resolved = resolve_source(EMBEDDED if location is None else location)
        model = None
        began = time.perf_counter()
        try:
            locks.wait_for_imports()  # a worker's preimport of torch and transformers
            import torch
            from transformers.utils import logging as hf_logging

            imported = time.perf_counter()

            # A progress bar per load would flood worker logs (one load per task at levels
            # partial and agnostic).
            hf_logging.disable_progress_bar()
            plan = plan_device(torch, self.device, self.dtype)
            baseline = _allocated(torch, plan)
            with _FROM_PRETRAINED:
                model, tokenizer = _from_pretrained(resolved, getattr(torch, plan.dtype))
            built = time.perf_counter()
            model.to(plan.device)
            model.eval()
            model.requires_grad_(False)
            _prepare_padding(tokenizer, model)
            lm = LanguageModel(model, tokenizer, plan.device, str(resolved.path))
            lm.dtype, lm.warning = plan.dtype, plan.warning
            limit = config.prefix_cache_bytes()
            lm.prefix_cache = PrefixCache(limit) if limit else None
            self._size_batches(torch, lm, plan)
            warming = time.perf_counter()
            _warm_up(lm, plan)
            if plan.is_cuda:
                lm.device_bytes = int(torch.cuda.max_memory_allocated(plan.device)) - baseline
        except ModelSourceError:
            raise
        except Exception as exc:
            if model is not None:
                _discard(model)
            raise ContextLoadError(
                f"could not load a causal LM from '{resolved.path}': {type(exc).__name__}: {exc}"
            ) from exc
        logger.info(
            "Loaded %s on %s as %s, batches of %d (%d generating): imports %.2f s, "
            "from_pretrained %.2f s, warm-up %.2f s",
            resolved.path,
            plan.device,
            plan.dtype,
            lm.batch_size,
            lm.generate_batch_size or lm.batch_size,
            imported - began,
            built - imported,
            time.perf_counter() - warming,
        )
        return lm

    def _size_batches(self, torch: Any, lm: LanguageModel, plan: DevicePlan) -> None:
        if not plan.is_cuda:
            # Host memory bounds a pass on the CPU as device memory does on a GPU: without
            # it, one very long prompt grew a worker until its nanny killed it, and again on
            # every worker it was sent to.
            lm.memory_budget = host_memory_budget()
            lm.batch_size = self.batch_size or CPU_BATCH_SIZE
            lm.generate_batch_size = self.batch_size or CPU_GENERATE_BATCH_SIZE
            return
        free, _ = torch.cuda.mem_get_info(torch.device(plan.device))
        lm.memory_budget = int(free * BATCH_MEMORY_FRACTION)
        if self.batch_size is not None:
            lm.batch_size = self.batch_size
            return
        element = next(lm.model.parameters()).element_size()
        need = prompt_bytes(lm.model.config, element, TOKENS_PER_PROMPT, "logits")
        lm.batch_size = rows_that_fit(lm.memory_budget, need)

    def list_files(self, template: str | os.PathLike[str] | None) -> TemplateFiles:
        """The files of ``template`` that travel to workers: the model's selection
        (:func:`dask_pcm.templates.sources.model_files`: config, safetensors weights and
        tokenizer files of a Hugging Face directory or hub snapshot, never pickle
        checkpoints; or the ``.gguf`` file).

        Raises
        ------
        ModelSourceError
            ``template`` is not a model (no ``config.json``, pickle weights only, missing).

        Example
        -------
        >>> CausalLM().list_files("/models/my-llama").names  # doctest: +SKIP
        ('config.json', 'model.safetensors', 'tokenizer.json', 'tokenizer_config.json')
        """
        return model_files(EMBEDDED if template is None else template)

    def estimate_bytes(self, location: str | os.PathLike[str] | None) -> int:
        """Memory a model loaded from ``location`` will take, before loading it: the size of
        its files (the weights dominate). The worker makes that much room first
        (``pcm.worker.context-memory-limit``); 0 when the location cannot be read yet."""
        return model_bytes(location)

    def release(self, lm: LanguageModel) -> None:
        """Drop ``lm``'s model and tokenizer and give their device memory back.

        Example
        -------
        >>> loader.release(lm)  # doctest: +SKIP
        """
        with lm.lock:  # not under a pass of another thread
            model, lm.model, lm.tokenizer = lm.model, None, None
            if lm.prefix_cache is not None:
                lm.prefix_cache.clear()
        if model is not None:
            _discard(model)


def model_bytes(location: str | os.PathLike[str] | None) -> int:
    """The size of the model files at ``location`` (``None``: the embedded model), what its
    weights take in memory; 0 when the location cannot be read."""
    try:
        resolved = resolve_source(EMBEDDED if location is None else location)
        return sum(p.stat().st_size for p in template_files(resolved))
    except (OSError, ModelSourceError):
        return 0


def host_memory_budget() -> int:
    """Bytes a forward pass may take on the CPU: :data:`BATCH_MEMORY_FRACTION` of what the
    worker's memory limit (distributed's ``memory_limit``; the host's memory outside a
    worker) leaves beside this process's resident memory, the model just loaded included."""
    import psutil

    limit = _worker_memory_limit() or psutil.virtual_memory().total
    resident = psutil.Process().memory_info().rss
    return int(max(limit - resident, 0) * BATCH_MEMORY_FRACTION)


def _worker_memory_limit() -> int | None:
    """The memory limit of the Dask worker this code runs in (``None``: no worker or no
    limit). Loads run in the worker plugin's threads, outside any task, so the worker is
    found as the process's only one (a worker process holds exactly one)."""
    from distributed import Worker, get_worker

    try:
        worker = get_worker()
    except ValueError:
        instances = list(Worker._instances)
        if len(instances) != 1:
            return None
        worker = instances[0]
    limit = getattr(getattr(worker, "memory_manager", None), "memory_limit", None)
    return int(limit) if limit else None


def _discard(model: Any) -> None:
    """Free a model's weights now and the GPU's cached blocks with them."""
    # Moving the parameters to the meta device frees their storage now, even if the module
    # sits in a reference cycle; a gc.collect() would do the same, but it walks every object
    # of a process holding torch, far slower than this.
    model.to("meta")
    free_cached_memory(sys.modules.get("torch"))


def _allocated(torch: Any, plan: DevicePlan) -> int:
    """The CUDA allocator's bytes in use on the plan's device before a load; peak reset."""
    if not plan.is_cuda:
        return 0
    torch.cuda.reset_peak_memory_stats(plan.device)
    return int(torch.cuda.memory_allocated(plan.device))


def _warm_up(lm: LanguageModel, plan: DevicePlan) -> None:
    """One forward pass at load time, so lazy set-up in torch is paid before the first task.

    The first passes of a fresh process run seconds slower (kernel selection, allocator
    growth); done here, that lands in the load time rather than in the first task. On a GPU
    the pass is a full batch of the longest prompts the batch size was chosen for, so a size
    that does not fit is found (and halved) here rather than by a task.

    On a CPU, a model built for one task (:func:`~dask_pcm.engine.model.build_for_one_task`:
    levels agnostic and partial) skips it: that task is its only pass, and a warm-up would
    be a second one.
    """
    if plan.is_cuda:
        lm.next_token_logits([" ".join(["yes"] * (TOKENS_PER_PROMPT - 2))] * lm.batch_size)
        return
    if building_for_one_task():
        return
    prompt = "Claim: the warm-up sentence of a freshly loaded model is true. Answer:"
    lm.next_token_logits([prompt] * min(lm.batch_size, CPU_BATCH_SIZE))


def _prepare_padding(tokenizer: Any, model: Any) -> None:
    """Left padding and a pad token, set once at load so no task call has to."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is not None:
            tokenizer.pad_token = tokenizer.eos_token
        else:
            # Padded positions are masked out, so any token in the vocabulary will do.
            tokenizer.pad_token = tokenizer.convert_ids_to_tokens(0)
    generation = getattr(model, "generation_config", None)
    if generation is not None and generation.pad_token_id is None:
        # Otherwise generate() warns and picks eos on every call.
        generation.pad_token_id = tokenizer.pad_token_id


# transformers' from_pretrained is not thread-safe: two threads of one process loading at
# once (threaded workers, several contexts, per-task loads at level agnostic) were seen to
# leave later loads with weights on the meta device. Loads within a process take turns.
_FROM_PRETRAINED = threading.Lock()


def _from_pretrained(resolved: ResolvedSource, dtype: Any) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if resolved.kind == "gguf":
        folder, name = str(resolved.path.parent), resolved.path.name
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    else:
        folder = str(resolved.path)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        # Never fall back to a pickle checkpoint lying beside the safetensors weights.
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, use_safetensors=True)
    return model, tokenizer
