"""A loaded causal language model: :class:`LanguageModel`, what a context task gets.

It runs lists of prompts in passes that fit the worker's device (see the class) and keeps the
tokenizer and model to one thread at a time. :class:`dask_pcm.engine.llm.CausalLM` builds it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dask_pcm.engine.generation import decode, eos_ids
from dask_pcm.engine.gpu import context_length, pass_problem
from dask_pcm.engine.passes import by_length, rows_for
from dask_pcm.engine.prefix import PrefixCache, States, last_logits
from dask_pcm.templates.embedded import EMBEDDED_NAME
from dask_pcm.templates.sources import EMBEDDED

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# Prompts per forward pass on a CPU worker, chosen with benchmarks/batch_sizes.py (its stamped
# JSON has the figures): beyond a few rows a CPU's matrix units are already busy, and longer
# batches only add padding.
CPU_BATCH_SIZE = 8
# Prompts per generation pass on a CPU worker. Each new token is one pass that reads every
# weight once, however many rows it holds: on a CPU that read, not the matrix units, bounds
# a decode step, so more rows per pass cost little more than fewer. The embedded
# SmolLM2-135M on one core, 32 chats of 16 new tokens: 7.4-8.3 s by 8, 5.2-5.8 s by 16,
# 4.2-4.3 s by 32 (scoring, one pass per prompt, gains nothing past a few rows).
CPU_GENERATE_BATCH_SIZE = 32
# Tokens assumed per prompt when sizing a GPU batch at load, and the warm-up's prompt length
# there (FEVER prompts, few-shot ones included, are 40 to 400 tokens). Longer prompts get
# fewer rows per pass when they come.
TOKENS_PER_PROMPT = 512

# Set while a worker builds a context for one task only (levels agnostic and partial): a
# loader may then skip work that pays off only over many tasks, such as a warm-up pass.
_FOR_ONE_TASK: ContextVar[bool] = ContextVar("dask_pcm_build_for_one_task", default=False)


@contextmanager
def build_for_one_task() -> Iterator[None]:
    """Within it, :func:`building_for_one_task` is true: the object built serves one task
    and is dropped (how levels ``agnostic`` and ``partial`` build, and a batch job that
    loads its model per task)."""
    token = _FOR_ONE_TASK.set(True)
    try:
        yield
    finally:
        _FOR_ONE_TASK.reset(token)


def building_for_one_task() -> bool:
    """Whether the build under way serves one task only (:func:`build_for_one_task`)."""
    return _FOR_ONE_TASK.get()


@dataclass
class LanguageModel:
    """A causal language model and its tokenizer, ready for inference.

    Built by :class:`CausalLM`; tasks get it from ``dask_pcm.get_context(name)``. Lists of
    prompts run ``batch_size`` at a time (chosen per worker for its device at load), prompts
    of similar length together; on a GPU a pass takes no more rows than ``memory_budget``
    holds for its longest prompt and method. A pass that runs out of memory is retried at
    half the rows, and the smaller ``batch_size`` is kept. One lock (``lock``) serialises the
    tokenizer and the model between a worker's threads: a fast tokenizer shared by threads
    fails ("Already borrowed"), and two passes at once would need twice the memory.

    Parameters
    ----------
    model
        A transformers causal LM in eval mode, without gradients, on ``device``.
    tokenizer
        Its tokenizer, with a pad token.
    device
        Where the model lives, e.g. ``"cpu"`` or ``"cuda:0"``.
    source
        The location it was loaded from (on a worker, its own copy of the template).
    origin
        The model as its context names it (the path or id the user gave), which the worker
        that built it sets; messages name it (:attr:`label`).
    batch_size
        Most prompts per forward pass on this worker.
    generate_batch_size
        Most prompts per pass of :meth:`generate` (and of every generation through
        :func:`~dask_pcm.engine.passes.in_passes`), where it differs from ``batch_size``
        (:data:`CPU_GENERATE_BATCH_SIZE` on a CPU unless a batch size was given); ``None``:
        ``batch_size``. A generation pass that runs out of memory lowers both.
    dtype
        The weights' dtype (``"float32"``, ``"float16"``, ``"bfloat16"``).
    memory_budget
        Device bytes a pass may fill (on a GPU: a share of the free device memory; on a
        CPU: a share of the worker's memory limit left after the model); ``None``:
        ``batch_size`` alone decides.
    device_bytes
        Device memory the model took at load, weights and warm-up pass (the CUDA allocator's
        count); ``None`` on the CPU.
    warning
        Why the model runs where it does, when that may surprise (a GPU it could not use).
    prefix_cache
        Key/value states of prompt prefixes kept for :meth:`next_token_logits` (``prefix=``);
        ``None``: none kept.

    Example
    -------
    >>> lm = CausalLM()("embedded")  # doctest: +SKIP
    >>> lm.complete(lm.chat_prompt("What is the capital of France?"))  # doctest: +SKIP
    'The capital of France is Paris.'
    """

    model: Any
    tokenizer: Any
    device: str
    source: str
    batch_size: int = CPU_BATCH_SIZE
    dtype: str = "float32"
    memory_budget: int | None = None
    device_bytes: int | None = None
    origin: str | None = None
    generate_batch_size: int | None = None

    @property
    def label(self) -> str:
        """The model as messages name it: :attr:`origin` where known, else :attr:`source`."""
        if self.origin == EMBEDDED:
            return f"{EMBEDDED} ({EMBEDDED_NAME})"
        return self.origin or self.source

    warning: str | None = None
    prefix_cache: PrefixCache | None = field(default=None, repr=False, compare=False)
    lock: Any = field(default_factory=threading.RLock, repr=False, compare=False)

    def rows_per_pass(self, prompts: list[str], method: str = "logits", new_tokens: int = 0) -> int:
        """Prompts per forward pass for ``prompts``: ``batch_size``, fewer where the memory
        budget does not hold that many of the longest prompt for ``method`` (``"logits"``, or
        ``"generate"`` with ``new_tokens``: a key/value cache in every pass)."""
        return rows_for(self, self._longest(prompts), method, new_tokens)

    def _longest(self, prompts: list[str]) -> int:
        """Tokens of the longest prompt; 0 when no memory budget asks for it."""
        if self.memory_budget is None or not prompts:
            return 0
        return max(len(ids) for ids in self.tokenizer(prompts)["input_ids"])

    def next_token_logits(self, prompts: Sequence[str], prefix: str | None = None) -> torch.Tensor:
        """Logits of the token after each prompt.

        Prompts of similar length share a forward pass (less padding); the result keeps the
        order of ``prompts``.

        Parameters
        ----------
        prompts
            The prompts (a list of strings, not a single string).
        prefix
            Text that every prompt starts with, e.g. a template's instructions and examples.
            The key/value cache of the tokens all prompts share with it is computed once and
            kept (``prefix_cache``), and each pass runs only the rest of each prompt: the same
            logits (to float rounding), a fraction of the work. ``None``: every pass runs
            whole prompts.

        Returns
        -------
        torch.Tensor
            Shape ``[len(prompts), vocab]``, float32, on the CPU.

        Example
        -------
        >>> logits = lm.next_token_logits(["The sky is", "Grass is"])  # doctest: +SKIP
        >>> lm.tokenizer.decode(logits.argmax(-1)[0])  # doctest: +SKIP
        ' blue'
        """
        import torch

        if isinstance(prompts, str):
            raise TypeError("next_token_logits takes a sequence of prompts; wrap one in a list")
        prompts = list(prompts)
        if not prompts:
            return torch.empty(0, self.model.config.vocab_size, dtype=torch.float32)
        pad = int(self.tokenizer.pad_token_id)

        def run(chunk: list[list[int]], states: States | None, start: int) -> torch.Tensor:
            return last_logits(self.model, chunk, pad, self.device, states, start)

        return torch.stack(by_length(self, prompts, prefix, run, "logits"))

    def next_token_logprobs(
        self, prompts: Sequence[str], token_ids: Sequence[int], prefix: str | None = None
    ) -> torch.Tensor:
        """The log-probability of each of ``token_ids`` as the token after each prompt:
        :meth:`next_token_logits` (``prefix`` as there), log-softmaxed, those columns.

        Example
        -------
        >>> lm.next_token_logprobs(["The sky is"], [lm.tokenizer.encode(" blue")[0]])  # doctest: +SKIP
        tensor([[-1.37]])
        """
        import torch

        logits = self.next_token_logits(prompts, prefix)
        return torch.log_softmax(logits, dim=-1)[:, list(token_ids)]

    def complete(self, prompt: str, max_new_tokens: int = 8) -> str:
        """Greedy continuation of ``prompt``: only the new text (:meth:`generate` of one).

        Example
        -------
        >>> lm.complete("The capital of France is", max_new_tokens=3)  # doctest: +SKIP
        ' Paris.'
        """
        return self.generate([prompt], max_new_tokens)[0]

    def generate(
        self, prompts: Sequence[str], max_new_tokens: int = 8, prefix: str | None = None
    ) -> list[str]:
        """Greedy continuations of a batch of prompts: only the new text.

        Prompts of similar length share passes, each one pass over the prompts (padded on
        the left) and one per new token over the key/value cache
        (:func:`~dask_pcm.engine.generation.decode`); a row ends at the end-of-sequence
        token. ``prefix``: as for :meth:`next_token_logits`, text every prompt starts with,
        whose tokens' states are kept: each pass runs only the rest of each prompt and the
        new tokens, and generates the same tokens (but where two are equally likely to
        float rounding).

        Example
        -------
        >>> lm.generate(["The capital of France is", "Two plus two is"], 3)  # doctest: +SKIP
        [' Paris.', ' four.']
        """
        if isinstance(prompts, str):
            raise TypeError("generate takes a sequence of prompts; wrap one in a list")
        prompts = list(prompts)
        if not prompts:
            return []
        eos = eos_ids(self.model, self.tokenizer)
        pad = int(self.tokenizer.pad_token_id)

        def run(chunk: list[list[int]], states: States | None, start: int) -> list[list[int]]:
            return decode(
                self.model,
                chunk,
                pad,
                self.device,
                max_tokens=max_new_tokens,
                eos=eos,
                prefix=states,
                prefix_len=start,
            )

        generated = by_length(self, prompts, prefix, run, "generate", max_new_tokens)
        with self.lock:
            return [str(self.tokenizer.decode(t, skip_special_tokens=True)) for t in generated]

    def chat_prompt(self, message: str) -> str:
        """``message`` as a user turn in the tokenizer's chat template, ready for the answer
        (unchanged without a chat template).

        Example
        -------
        >>> lm.complete(lm.chat_prompt("What is the capital of France?"))  # doctest: +SKIP
        'The capital of France is Paris.'
        """
        return chat_prompt(self.tokenizer, message)

    @property
    def prefix_cache_bytes(self) -> int:
        """Bytes of the kept prefix states (on the model's device)."""
        return 0 if self.prefix_cache is None else self.prefix_cache.nbytes

    @property
    def nbytes(self) -> int:
        """Bytes the model holds: on a GPU the allocator's count at load (weights and the
        warm-up pass), elsewhere its parameters.

        Example
        -------
        >>> lm.nbytes  # doctest: +SKIP
        538039296
        """
        if self.device_bytes is not None:
            return self.device_bytes
        return sum(p.numel() * p.element_size() for p in self.model.parameters())


def prompt_problem(
    lm: LanguageModel, tokens: int, method: str = "logits", new_tokens: int = 0
) -> str | None:
    """Why a prompt of ``tokens`` tokens cannot run on ``lm``, or ``None``: more tokens
    (``new_tokens`` to generate included) than the model's context, or more memory for one
    pass of it alone than ``lm.memory_budget`` (:func:`dask_pcm.engine.gpu.pass_problem`).

    Example
    -------
    >>> prompt_problem(lm, 100_000)  # doctest: +SKIP
    "100000 tokens exceed the model's context of 8192 tokens"
    """
    own = getattr(lm, "prompt_problem", None)  # another engine (vLLM) says for itself
    if own is not None:
        problem: str | None = own(tokens, method, new_tokens)
        return problem
    element = next(lm.model.parameters()).element_size()
    where = f"{lm.device} (model {lm.label})"
    return pass_problem(
        lm.model.config, element, lm.memory_budget, tokens, method, new_tokens, where
    )


def max_tokens(lm: LanguageModel) -> int | None:
    """The most tokens ``lm`` takes in one sequence (its context); ``None`` when unsaid."""
    given = getattr(lm, "max_model_len", None)  # another engine's (vLLM)
    return int(given) if given else context_length(getattr(lm.model, "config", None))


def count_tokens(lm: LanguageModel, texts: Sequence[str]) -> list[int]:
    """Tokens of each of ``texts`` as ``lm``'s prompts tokenize (under its lock)."""
    with lm.lock:
        return [len(ids) for ids in lm.tokenizer(list(texts))["input_ids"]]


def token_bounds(lm: LanguageModel, texts: Sequence[str]) -> list[int] | None:
    """At least as many tokens as each of ``texts`` takes, without tokenizing it, or ``None``
    when ``lm``'s tokenizer gives no such bound.

    A byte-level tokenizer without a normalizer (GPT-2's kind: Llama 3, SmolLM2, Qwen) turns
    every byte into one symbol and merges symbols: a text takes at most one token per UTF-8
    byte, plus the special tokens added around it.
    """
    backend = getattr(lm.tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None:
        return None
    if "ByteLevel" not in repr(backend.pre_tokenizer):
        return None
    added = int(lm.tokenizer.num_special_tokens_to_add())
    return [len(text.encode("utf-8")) + added for text in texts]


def prompt_problems(
    lm: LanguageModel, prompts: Sequence[str], method: str = "logits", new_tokens: int = 0
) -> list[str | None]:
    """:func:`prompt_problem` of each of ``prompts``; those that fit whatever they tokenize to
    (:func:`token_bounds`) are not tokenized to find out (a second tokenization of every
    prompt is a share of a worker's time worth saving when its prompts are short)."""
    bounds = token_bounds(lm, prompts)
    if not prompts or (bounds and prompt_problem(lm, max(bounds), method, new_tokens) is None):
        return [None] * len(prompts)  # the longest fits: all do (more tokens never fit better)
    unsure = [
        i for i in range(len(prompts))
        if bounds is None or prompt_problem(lm, bounds[i], method, new_tokens) is not None
    ]  # fmt: skip
    problems: list[str | None] = [None] * len(prompts)
    if unsure:
        counted = count_tokens(lm, [prompts[i] for i in unsure])
        for i, tokens in zip(unsure, counted, strict=True):
            problems[i] = prompt_problem(lm, tokens, method, new_tokens)
    return problems


def chat_prompt(tokenizer: Any, message: str) -> str:
    """``message`` as a user turn in ``tokenizer``'s chat template, or as it is."""
    if not getattr(tokenizer, "chat_template", None):
        return message
    turn = [{"role": "user", "content": message}]
    return str(tokenizer.apply_chat_template(turn, tokenize=False, add_generation_prompt=True))
