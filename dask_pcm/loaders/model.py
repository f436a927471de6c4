"""A loaded causal language model: :class:`LanguageModel`, what a context task gets.

It runs lists of prompts in passes that fit the worker's device (see the class) and keeps the
tokenizer and model to one thread at a time. :class:`dask_pcm.loaders.llm.CausalLM` builds it.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dask_pcm.exceptions import DeviceMemoryError
from dask_pcm.loaders.gpu import free_cached_memory, is_out_of_memory, prompt_bytes, rows_that_fit

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# Prompts per forward pass on a CPU worker. Measured with benchmarks/fever_batch_sizes.py, now
# batch_sizes.py (SmolLM2-135M, FEVER prompts, 2 workers on 2 vCPUs): 6.8 claims/s at 1, 9.9 at 8, 8.1 at 32.
# Beyond a few rows a CPU's matrix units are already busy, and longer batches only add padding.
CPU_BATCH_SIZE = 8
# Tokens assumed per prompt when sizing a GPU batch at load, and the warm-up's prompt length
# there (FEVER prompts, few-shot ones included, are 40 to 400 tokens). Longer prompts get
# fewer rows per pass when they come.
TOKENS_PER_PROMPT = 512


@dataclass
class LanguageModel:
    """A causal language model and its tokenizer, ready for inference.

    Built by :class:`CausalLM`; tasks get it from ``dask_pcm.get_context(name)``. The tokenizer
    pads on the left, so that the last position of every row in a batch is its real last token.
    Longer lists of prompts are run ``batch_size`` at a time, a size chosen per worker for its
    device when the model loads, so one work unit suits a CPU worker and a GPU worker alike.
    On a GPU a pass also takes no more rows than ``memory_budget`` holds for the longest
    prompt and the method (generation keeps a key/value cache). A pass that runs out of
    memory is retried at half the rows, and the smaller ``batch_size`` is kept.

    One lock (``lock``) serialises the tokenizer and the model between threads of a worker:
    a fast tokenizer used by two threads at once fails ("Already borrowed"), and two passes
    at once would need twice the memory the batch was sized for.

    Parameters
    ----------
    model
        A transformers causal LM in eval mode, without gradients, on ``device``.
    tokenizer
        Its tokenizer, with a pad token.
    device
        Where the model lives, e.g. ``"cpu"`` or ``"cuda:0"``.
    source
        The location it was loaded from.
    batch_size
        Most prompts per forward pass on this worker.
    dtype
        The weights' dtype (``"float32"``, ``"float16"``, ``"bfloat16"``).
    memory_budget
        Device bytes a pass may fill (on a GPU); ``None``: ``batch_size`` alone decides.
    device_bytes
        Device memory the model took at load, weights and warm-up pass (the CUDA allocator's
        count); ``None`` on the CPU.
    warning
        Why the model runs where it does, when that may surprise (a GPU it could not use).

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
    warning: str | None = None
    lock: Any = field(default_factory=threading.RLock, repr=False, compare=False)

    def rows_per_pass(self, prompts: list[str], method: str = "logits", new_tokens: int = 0) -> int:
        """Prompts per forward pass for ``prompts``: ``batch_size``, fewer where the memory
        budget does not hold that many of the longest prompt for ``method`` (``"logits"`` or
        ``"generate"`` with ``new_tokens``)."""
        rows = max(1, int(self.batch_size))
        if self.memory_budget is None:
            return rows
        longest = max(len(ids) for ids in self.tokenizer(prompts)["input_ids"])
        element = next(self.model.parameters()).element_size()
        need = prompt_bytes(self.model.config, element, longest, method, new_tokens)
        return min(rows, rows_that_fit(self.memory_budget, need))

    def _batched(
        self,
        prompts: list[str],
        run: Callable[[list[str]], Any],
        method: str,
        new_tokens: int = 0,
    ) -> list[Any]:
        """``run`` over ``prompts`` in passes that fit, halving a pass that runs out of memory."""
        parts: list[Any] = []
        with self.lock:
            rows = self.rows_per_pass(prompts, method, new_tokens)
            done = 0
            while done < len(prompts):
                chunk = prompts[done : done + rows]
                try:
                    parts.append(run(chunk))
                    done += len(chunk)
                    continue
                except Exception as exc:
                    if not is_out_of_memory(exc):
                        raise
                    error = f"{type(exc).__name__}: {exc}"
                # Out of the except block: the failed pass's tensors are unreachable now.
                rows = self._halve(len(chunk), method, error)
        return parts

    def _halve(self, rows: int, method: str, error: str) -> int:
        free_cached_memory(sys.modules.get("torch"))
        if rows <= 1:
            raise DeviceMemoryError(
                f"one prompt per pass does not fit in memory on {self.device} "
                f"({method}, model {self.source}): {error}"
            )
        smaller = rows // 2
        self.batch_size = min(self.batch_size, smaller)
        logger.warning(
            "Out of memory at %d prompts per pass on %s (%s): %d per pass from now on",
            rows,
            self.device,
            method,
            smaller,
        )
        return smaller

    def next_token_logits(self, prompts: Sequence[str]) -> torch.Tensor:
        """Logits of the token after each prompt, as one batch.

        Parameters
        ----------
        prompts
            The prompts (a list of strings, not a single string).

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
        return torch.cat(self._batched(prompts, self._next_token_logits, "logits"))

    def _next_token_logits(self, prompts: list[str]) -> torch.Tensor:
        import torch

        with torch.inference_mode():
            enc = self.tokenizer(prompts, return_tensors="pt", padding=True).to(self.device)
            mask = enc["attention_mask"]
            # Positions count real tokens only, so a left-padded row sees the same positions
            # as the same prompt alone.
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            out = self.model(
                input_ids=enc["input_ids"],
                attention_mask=mask,
                position_ids=positions,
                logits_to_keep=1,
                use_cache=False,
            )
            return out.logits[:, -1, :].float().cpu()

    def complete(self, prompt: str, max_new_tokens: int = 8) -> str:
        """Greedy continuation of ``prompt``: only the new text.

        Example
        -------
        >>> lm.complete("The capital of France is", max_new_tokens=3)  # doctest: +SKIP
        ' Paris.'
        """
        import torch

        with self.lock, torch.inference_mode():
            enc = self.tokenizer(prompt, return_tensors="pt").to(self.device)
            out = self.model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
            new_tokens = out[0, enc["input_ids"].shape[1] :]
            return str(self.tokenizer.decode(new_tokens, skip_special_tokens=True))

    def generate(self, prompts: Sequence[str], max_new_tokens: int = 8) -> list[str]:
        """Greedy continuations of a batch of prompts (left-padded): only the new text.

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

        def run(chunk: list[str]) -> list[str]:
            return self._generate(chunk, max_new_tokens)

        return [t for part in self._batched(prompts, run, "generate", max_new_tokens) for t in part]

    def _generate(self, prompts: list[str], max_new_tokens: int) -> list[str]:
        import torch

        with torch.inference_mode():
            enc = self.tokenizer(prompts, return_tensors="pt", padding=True).to(self.device)
            out = self.model.generate(
                **enc,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=self.tokenizer.pad_token_id,
            )
        new_tokens = out[:, enc["input_ids"].shape[1] :]
        return [str(t) for t in self.tokenizer.batch_decode(new_tokens, skip_special_tokens=True)]

    def chat_prompt(self, message: str) -> str:
        """``message`` as a user turn in the tokenizer's chat template, ready for the answer.

        Returns ``message`` unchanged when the tokenizer has no chat template.

        Example
        -------
        >>> lm.complete(lm.chat_prompt("What is the capital of France?"))  # doctest: +SKIP
        'The capital of France is Paris.'
        """
        if not getattr(self.tokenizer, "chat_template", None):
            return message
        return str(
            self.tokenizer.apply_chat_template(
                [{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True
            )
        )

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
