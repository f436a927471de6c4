"""The inference engine: what builds a language-model context from its template and runs it.

:mod:`~dask_pcm.engine.llm` (:class:`~dask_pcm.CausalLM`, the loader, and
:class:`~dask_pcm.LanguageModel`, the built context), :mod:`~dask_pcm.engine.model` (passes
that fit the device, halving on out-of-memory), :mod:`~dask_pcm.engine.gpu` (device, dtype,
memory per prompt), :mod:`~dask_pcm.engine.prefix` (key/value states of a shared prefix),
:mod:`~dask_pcm.engine.generation` and :mod:`~dask_pcm.engine.passes`. The embedded default
model is a template source: :mod:`dask_pcm.templates.embedded`.
"""
