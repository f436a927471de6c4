"""dask_pcm: Pervasive Context Management for Dask.

Keep the expensive, reusable state of many small tasks (an LLM on its device, its
tokenizer) resident on Dask workers, and run thousands of small inference tasks against it.

Examples
--------
>>> import dask_pcm
>>> from distributed import Client
>>> client = Client(dask_pcm.local_cluster(n_workers=2))             # doctest: +SKIP
>>> dask_pcm.register(client, dask_pcm.causal_lm(name="smollm2"))   # doctest: +SKIP
>>> def complete(prompt):
...     return dask_pcm.get_context("smollm2").complete(prompt)
>>> dask_pcm.submit(client, complete, "The capital of France is", context="smollm2").result()  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from dask_pcm import _moved
from dask_pcm import config as _config  # noqa: F401  (loads the pcm namespace defaults)
from dask_pcm.client import (
    map as map,  # dask_pcm.map; not in __all__ (see below)
)
from dask_pcm.client import (
    register,
    registered_contexts,
    status,
    status_page,
    submit,
    unregister,
)
from dask_pcm.context import Context, causal_lm, vllm_lm
from dask_pcm.engine.llm import CausalLM, LanguageModel
from dask_pcm.exceptions import (
    BatchInputError,
    BatchJobError,
    ChunkError,
    ClusterLostError,
    ContextLoadError,
    ContextNotFoundError,
    ContextTimeoutError,
    DeviceMemoryError,
    ModelSourceError,
    NoWorkerError,
    OutputFolderError,
    PCMError,
    PromptTooLongError,
    TemplateFetchError,
    UnitError,
)
from dask_pcm.tasks import ContextTask, get_context, uses_context

_moved.install_aliases()  # old module paths (dask_pcm.fever, dask_pcm.loaders...) for one release

# ``map`` is dask_pcm.map but not in __all__: ``from dask_pcm import *`` must not shadow the
# built-in.

# Imported on first use (PEP 562): every worker and scheduler imports dask_pcm, and none of
# them needs the batch layer, the FEVER application, the cluster starters (dask-jobqueue),
# the doctor or the test models until a client calls them.
_LAZY = {
    "BatchResult": "dask_pcm.batch",
    "run_batch": "dask_pcm.batch",
    "FeverFormatError": "dask_pcm.apps.fever.errors",
    "FeverResult": "dask_pcm.apps.fever.run",
    "run_fever": "dask_pcm.apps.fever.run",
    "Nanny": "dask_pcm.deploy.local",
    "local_cluster": "dask_pcm.deploy.local",
    "batch_cluster": "dask_pcm.deploy.jobqueue",
    "WorkerReport": "dask_pcm.diagnosis",
    "doctor": "dask_pcm.diagnosis",
    "embedded_model_dir": "dask_pcm.templates.embedded",
    "build_tiny_llama": "dask_pcm.testing.models",  # not under TYPE_CHECKING below: the
    # library never imports its test helpers, not even for type checking
}

if TYPE_CHECKING:
    from dask_pcm.apps.fever.errors import FeverFormatError
    from dask_pcm.apps.fever.run import FeverResult, run_fever
    from dask_pcm.batch import BatchResult, run_batch
    from dask_pcm.deploy.jobqueue import batch_cluster
    from dask_pcm.deploy.local import Nanny, local_cluster
    from dask_pcm.diagnosis import WorkerReport, doctor
    from dask_pcm.templates.embedded import embedded_model_dir


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dask_pcm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups find it without coming here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


try:
    __version__ = version("dask-pcm")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0+unknown"

__all__ = [
    "BatchInputError",
    "BatchJobError",
    "BatchResult",
    "CausalLM",
    "ChunkError",
    "ClusterLostError",
    "Context",
    "ContextLoadError",
    "ContextNotFoundError",
    "ContextTask",
    "ContextTimeoutError",
    "DeviceMemoryError",
    "FeverFormatError",
    "FeverResult",
    "LanguageModel",
    "ModelSourceError",
    "Nanny",
    "NoWorkerError",
    "OutputFolderError",
    "PCMError",
    "PromptTooLongError",
    "TemplateFetchError",
    "UnitError",
    "WorkerReport",
    "__version__",
    "batch_cluster",
    "build_tiny_llama",
    "causal_lm",
    "doctor",
    "embedded_model_dir",
    "get_context",
    "local_cluster",
    "register",
    "registered_contexts",
    "run_batch",
    "run_fever",
    "status",
    "status_page",
    "submit",
    "unregister",
    "uses_context",
    "vllm_lm",
]
