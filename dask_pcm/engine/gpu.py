"""Where a model runs and how much it may take there: device, dtype and batch memory.

Pure functions of a ``torch`` module passed in (tests pass one with a mocked ``torch.cuda``),
used by :class:`dask_pcm.engine.llm.CausalLM` at load time and by ``dask-pcm doctor``:

- :func:`plan_device`: the worker's own device and a dtype by its compute capability
  (bfloat16 from 8.0, Ampere on; float16 at 7.x; float32 below and on the CPU), falling back to
  the CPU *with a warning* when a GPU is there but this torch cannot use it;
- :func:`prompt_bytes`: device memory one prompt needs in one forward pass, the key/value cache
  included for generation;
- :func:`rows_that_fit`: prompts per pass for a memory budget;
- :func:`is_out_of_memory`: whether an error is the device (or host) running out of memory.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from dask_pcm.exceptions import DeviceMemoryError
from dask_pcm.gpus import driver_version, installed_gpus

logger = logging.getLogger(__name__)

DTYPES = ("auto", "float32", "float16", "bfloat16")

# Share of the device memory left free after the weights that batches may fill. The rest is
# for the CUDA allocator's fragmentation, cuBLAS workspaces and the estimate's error.
BATCH_MEMORY_FRACTION = 0.7
# Most prompts per forward pass on a GPU, however much memory there is.
GPU_MAX_BATCH_SIZE = 256


@dataclass(frozen=True)
class DevicePlan:
    """What a worker's context runs on.

    Attributes
    ----------
    device
        A torch device string: ``"cpu"`` or ``"cuda:0"``.
    dtype
        ``"float32"``, ``"float16"`` or ``"bfloat16"``.
    gpu, capability, total_memory
        The GPU's name, compute capability and memory in bytes (``None`` on the CPU).
    warning
        Why a GPU that is there is not used, or is used in a way that may disappoint.
    """

    device: str
    dtype: str
    gpu: str | None = None
    capability: tuple[int, int] | None = None
    total_memory: int | None = None
    warning: str | None = None

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")


def dtype_for(capability: tuple[int, int] | None) -> str:
    """The dtype for a compute capability (``None``: the CPU).

    Example
    -------
    >>> dtype_for((8, 6)), dtype_for((7, 5)), dtype_for((6, 1)), dtype_for(None)
    ('bfloat16', 'float16', 'float32', 'float32')
    """
    if capability is None or capability < (7, 0):
        # Pascal and older: bfloat16 is emulated and float16 runs at a fraction of float32
        # speed on most of them (TITAN X, GTX 10x0), so float32 is both safe and fastest.
        return "float32"
    if capability < (8, 0):
        return "float16"  # Volta, Turing: fast float16 (tensor cores), no native bfloat16
    return "bfloat16"


def arch_supported(arch_list: list[str], capability: tuple[int, int]) -> bool:
    """Whether a torch build compiled for ``arch_list`` (``torch.cuda.get_arch_list()``)
    runs on a GPU of ``capability``.

    Kernels for ``sm_XY`` run on the same major version with an equal or higher minor;
    PTX (``compute_XY``) is compiled at run time for any newer device. An empty list (no
    information) counts as supported.

    Example
    -------
    >>> arch_supported(["sm_75", "sm_80", "sm_90"], (8, 6))
    True
    >>> arch_supported(["sm_75", "sm_80", "sm_90"], (6, 1))
    False
    """
    if not arch_list:
        return True
    major, minor = capability
    for arch in arch_list:
        kind, _, digits = arch.partition("_")
        if not digits.isdigit() or len(digits) < 2:
            continue
        a_major, a_minor = int(digits[:-1]), int(digits[-1])
        if kind == "sm" and a_major == major and a_minor <= minor:
            return True
        if kind == "compute" and (a_major, a_minor) <= (major, minor):
            return True
    return False


def plan_device(torch: Any, device: str = "auto", dtype: str = "auto") -> DevicePlan:
    """Where and in what dtype to run (see the module docstring).

    ``device="auto"``: this worker's current CUDA device when torch can use it, else the CPU
    (with a warning when a GPU is there but unusable). An explicit device is taken as given.
    """
    if device == "auto":
        device, warning = _auto_device(torch)
    else:
        warning = None
    if not device.startswith("cuda"):
        return DevicePlan(device, _dtype(dtype, None), warning=warning)
    index = torch.device(device).index
    if index is None:
        index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    capability = (int(props.major), int(props.minor))
    return DevicePlan(
        f"cuda:{index}",
        _dtype(dtype, capability),
        gpu=str(props.name),
        capability=capability,
        total_memory=int(props.total_memory),
        warning=warning,
    )


def _dtype(requested: str, capability: tuple[int, int] | None) -> str:
    if requested not in DTYPES:
        raise ValueError(f"unknown dtype {requested!r}: use one of {', '.join(DTYPES)}")
    return dtype_for(capability) if requested == "auto" else requested


def _auto_device(torch: Any) -> tuple[str, str | None]:
    if torch.cuda.is_available():
        index = torch.cuda.current_device()
        capability = tuple(torch.cuda.get_device_capability(index))
        arch = list(torch.cuda.get_arch_list())
        if arch_supported(arch, capability):
            return f"cuda:{index}", None
        name = torch.cuda.get_device_name(index)
        return "cpu", (
            f"GPU {name} (compute capability {capability[0]}.{capability[1]}) is not supported "
            f"by torch {torch.__version__} (built for {' '.join(arch)}): running on the CPU. "
            f"Install a torch build with sm_{capability[0]}{capability[1]} kernels."
        )
    gpus = installed_gpus()
    if not gpus:
        return "cpu", None
    cuda = getattr(torch.version, "cuda", None)
    driver = driver_version() or "unknown"
    why = (
        "it is a CPU-only build"
        if not cuda
        else f"its CUDA {cuda} runtime may need a newer driver than {driver}"
    )
    return "cpu", (
        f"{gpus} NVIDIA GPU(s) on this host, but torch {torch.__version__} cannot use them "
        f"({why}; CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}): running "
        "on the CPU. "
        "Run `dask-pcm doctor` for details."
    )


def prompt_bytes(
    config: Any,
    element: int,
    tokens: int,
    method: str = "logits",
    new_tokens: int = 0,
    cached: int = 0,
) -> int:
    """Device memory one prompt of ``tokens`` tokens needs in one forward pass.

    ``method="logits"`` is one pass without a cache; ``"generate"`` adds the key/value cache
    of every layer for the prompt and ``new_tokens``. ``cached``: tokens of a kept prefix
    before the prompt, whose key/value states every sequence of the pass holds a copy of
    (and its queries attend to). Activations are those of one layer at a time (the residual
    stream, the MLP's gate, up and activation, the attention scores), so the estimate errs
    large for memory-efficient attention.

    Example
    -------
    >>> from types import SimpleNamespace
    >>> config = SimpleNamespace(hidden_size=64, num_hidden_layers=2, vocab_size=100)
    >>> prompt_bytes(config, 4, 10, "generate", 8, cached=90) - prompt_bytes(config, 4, 10)
    114192
    """
    hidden = int(config.hidden_size)
    heads = int(getattr(config, "num_attention_heads", 0) or 1)
    kv_heads = int(getattr(config, "num_key_value_heads", 0) or heads)
    head_dim = int(getattr(config, "head_dim", 0) or hidden // heads)
    layers = int(getattr(config, "num_hidden_layers", 0) or 1)
    inner = int(getattr(config, "intermediate_size", 0) or 4 * hidden)
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    keys = cached + tokens
    activations = tokens * element * (4 * hidden + 3 * inner) + heads * tokens * keys * element
    logits = 2 * vocab * 4  # the last position's logits, and their float32 copy
    cache = 0
    if method == "generate" or cached:
        keys += new_tokens if method == "generate" else 0
        cache = 2 * layers * kv_heads * head_dim * keys * element
    return activations + logits + cache


def context_length(config: Any) -> int | None:
    """The most tokens a model of ``config`` takes in one sequence; ``None`` when unsaid."""
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def pass_problem(
    config: Any,
    element: int,
    budget: int | None,
    tokens: int,
    method: str = "logits",
    new_tokens: int = 0,
    where: str = "this device",
) -> str | None:
    """Why a prompt of ``tokens`` tokens cannot run on a model of ``config`` with ``element``
    bytes per weight, or ``None``: more tokens (``new_tokens`` to generate included) than the
    model's context, or more than ``budget`` bytes for one pass of it alone.

    Example
    -------
    >>> from types import SimpleNamespace
    >>> config = SimpleNamespace(hidden_size=64, max_position_embeddings=512)
    >>> pass_problem(config, 4, None, 1000)
    "1000 tokens exceed the model's context of 512 tokens"
    """
    limit = context_length(config)
    if limit is not None and tokens + new_tokens > limit:
        wanted = f"{tokens} tokens" + (f" + {new_tokens} to generate" if new_tokens else "")
        return f"{wanted} exceed the model's context of {limit} tokens"
    if budget is not None:
        need = prompt_bytes(config, element, tokens, method, new_tokens)
        if need > budget:
            return (
                f"one forward pass of {tokens} tokens needs about {need / 2**30:.2f} GiB, "
                f"over the {budget / 2**30:.2f} GiB a pass may take on {where}"
            )
    return None


def rows_that_fit(budget: int, per_prompt: int, most: int = GPU_MAX_BATCH_SIZE) -> int:
    """Prompts per pass that fit ``budget`` bytes: a power of two, from 1 to ``most``.

    Example
    -------
    >>> rows_that_fit(10_000, 1_000), rows_that_fit(10, 1_000), rows_that_fit(10**12, 1)
    (8, 1, 256)
    """
    fits = max(1, budget // max(1, per_prompt))
    return int(min(most, 1 << (fits.bit_length() - 1)))


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is a device (or host) allocation failure that a smaller batch may avoid."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and (
        "out of memory" in text.lower()
        or "CUBLAS_STATUS_ALLOC_FAILED" in text
        or "can't allocate memory" in text
    )


def halved(rows: int, where: str, error: str) -> int:
    """Rows for the retry of a pass of ``rows`` that ran out of memory ``where``: half.

    Raises :class:`~dask_pcm.exceptions.DeviceMemoryError` when one row did not fit.
    """
    if rows <= 1:
        raise DeviceMemoryError(f"one prompt per pass does not fit in memory on {where}: {error}")
    smaller = rows // 2
    logger.warning(
        "Out of memory at %d prompts per pass on %s: %d per pass from now on", rows, where, smaller
    )
    return smaller


def free_cached_memory(torch: Any) -> None:
    """Give the CUDA allocator's cached blocks back, where CUDA is in use already
    (initialising it here would cost seconds for nothing)."""
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
