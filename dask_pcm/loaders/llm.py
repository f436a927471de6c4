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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dask_pcm.exceptions import ContextLoadError, ModelSourceError
from dask_pcm.templates.sources import ResolvedSource, resolve_source

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_DTYPES = ("auto", "float32", "float16", "bfloat16")

# Prompts per forward pass on a CPU worker. Measured with benchmarks/fever_batch_sizes.py, now
# batch_sizes.py (SmolLM2-135M, FEVER prompts, 2 workers on 2 vCPUs): 6.8 claims/s at 1, 9.9 at 8, 8.1 at 32.
# Beyond a few rows a CPU's matrix units are already busy, and longer batches only add padding.
CPU_BATCH_SIZE = 8
# On a GPU the batch is sized from the free device memory (see _auto_batch_size), at most this.
GPU_MAX_BATCH_SIZE = 256
# Tokens assumed per prompt when sizing a GPU batch (FEVER prompts, few-shot ones included,
# are 40 to 400 tokens).
_TOKENS_PER_PROMPT = 512


@dataclass
class LanguageModel:
    """A causal language model and its tokenizer, ready for inference.

    Built by :class:`CausalLM`; tasks get it from ``dask_pcm.get_context(name)``. The tokenizer
    pads on the left, so that the last position of every row in a batch is its real last token.
    Longer lists of prompts are run ``batch_size`` at a time, a size chosen per worker for its
    device when the model loads, so one work unit suits a CPU worker and a GPU worker alike.

    Parameters
    ----------
    model
        A transformers causal LM in eval mode, without gradients, on ``device``.
    tokenizer
        Its tokenizer, with a pad token.
    device
        Where the model lives, e.g. ``"cpu"`` or ``"cuda"``.
    source
        The location it was loaded from.
    batch_size
        Most prompts per forward pass on this worker.

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

    def _chunks(self, prompts: Sequence[str]) -> list[list[str]]:
        size = max(1, int(self.batch_size))
        return [list(prompts[i : i + size]) for i in range(0, len(prompts), size)]

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
        return torch.cat([self._next_token_logits(chunk) for chunk in self._chunks(prompts)])

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

        with torch.inference_mode():
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
        import torch

        if isinstance(prompts, str):
            raise TypeError("generate takes a sequence of prompts; wrap one in a list")
        prompts = list(prompts)
        if not prompts:
            return []
        if len(prompts) > self.batch_size:
            return [
                text
                for chunk in self._chunks(prompts)
                for text in self.generate(chunk, max_new_tokens)
            ]
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
        """Bytes held by the model's parameters.

        Example
        -------
        >>> lm.nbytes  # doctest: +SKIP
        538039296
        """
        return sum(p.numel() * p.element_size() for p in self.model.parameters())


@dataclass(frozen=True)
class CausalLM:
    """Loader of causal language models: ``CausalLM()(location)`` gives a :class:`LanguageModel`.

    Small and picklable (only the two options travel); equal options mean equal loaders, also
    for Dask's tokenizer. The heavy imports and the load happen when it is called.

    Parameters
    ----------
    device
        ``"auto"`` (CUDA when available, else CPU), or a torch device string such as ``"cpu"``
        or ``"cuda:1"``.
    dtype
        ``"auto"`` (float32 on CPU; bfloat16 on CUDA where supported, else float16),
        ``"float32"``, ``"float16"`` or ``"bfloat16"``.
    batch_size
        Most prompts per forward pass. ``None`` chooses per worker when the model loads:
        :data:`CPU_BATCH_SIZE` on a CPU; on a GPU, as many as half the free device memory
        holds at 512 tokens a prompt, rounded down to a power of two, at most
        :data:`GPU_MAX_BATCH_SIZE`.

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
        if self.dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}: use one of {', '.join(_DTYPES)}")
        if not isinstance(self.device, str) or not self.device:
            raise ValueError(f"device must be a non-empty string, got {self.device!r}")

    def __dask_tokenize__(self) -> tuple[str, str, str, int | None]:
        return (type(self).__qualname__, self.device, self.dtype, self.batch_size)

    def __call__(self, location: str | os.PathLike[str] | None) -> LanguageModel:
        """Load the model at ``location`` (anything :func:`dask_pcm.templates.sources.resolve_source` takes).

        Raises
        ------
        ModelSourceError
            The location cannot be used (missing, wrong format, hub offline).
        ContextLoadError
            Loading failed; the message names the model path and the original error.
        """
        resolved = resolve_source(location)
        try:
            import torch
            from transformers.utils import logging as hf_logging

            # A progress bar per load would flood worker logs (one load per task at levels
            # partial and agnostic).
            hf_logging.disable_progress_bar()
            device = self._device(torch)
            dtype = self._dtype(torch, device)
            with _FROM_PRETRAINED:
                model, tokenizer = _from_pretrained(resolved, dtype)
            model.to(device)
            model.eval()
            model.requires_grad_(False)
            _prepare_padding(tokenizer, model)
        except ModelSourceError:
            raise
        except Exception as exc:
            raise ContextLoadError(
                f"could not load a causal LM from '{resolved.path}': {type(exc).__name__}: {exc}"
            ) from exc
        batch_size = self.batch_size or _auto_batch_size(torch, model, device)
        lm = LanguageModel(model, tokenizer, device, str(resolved.path), batch_size)
        _warm_up(lm)
        logger.debug(
            "loaded %s on %s as %s, batches of %d", resolved.path, device, dtype, batch_size
        )
        return lm

    def release(self, lm: LanguageModel) -> None:
        """Drop ``lm``'s model and tokenizer and give their device memory back.

        Example
        -------
        >>> loader.release(lm)  # doctest: +SKIP
        """
        model, lm.model, lm.tokenizer = lm.model, None, None
        if model is not None:
            # Moving the parameters to the meta device frees their storage now, even if
            # the module sits in a reference cycle; a gc.collect() would do the same but
            # costs ~0.4 s in a process holding torch, far more than this.
            model.to("meta")
        torch = sys.modules.get("torch")
        # Only when CUDA is in use already: initialising it here would cost seconds for nothing.
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    def _device(self, torch: Any) -> str:
        if self.device != "auto":
            return self.device
        return "cuda" if torch.cuda.is_available() else "cpu"

    def _dtype(self, torch: Any, device: str) -> Any:
        if self.dtype != "auto":
            return getattr(torch, self.dtype)
        if not device.startswith("cuda"):
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def _auto_batch_size(torch: Any, model: Any, device: str) -> int:
    """Prompts per forward pass for ``device`` (see :class:`CausalLM`)."""
    if not device.startswith("cuda"):
        return CPU_BATCH_SIZE
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    config = model.config
    width = max(getattr(config, "intermediate_size", 0) or 0, 4 * config.hidden_size)
    element = next(model.parameters()).element_size()
    # Peak activations of one layer without a KV cache, with headroom for attention and
    # the tokenizer's padding: a few [tokens, width] tensors per prompt.
    per_prompt = _TOKENS_PER_PROMPT * width * element * 4
    fits = max(1, int(free * 0.5) // per_prompt)
    return int(min(GPU_MAX_BATCH_SIZE, 1 << (fits.bit_length() - 1)))


def _warm_up(lm: LanguageModel) -> None:
    """One forward pass at load time, so lazy set-up in torch is paid before the first task.

    The first passes of a fresh process run seconds slower (kernel selection, allocator
    growth); done here, that lands in the load time rather than in the first task.
    """
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
