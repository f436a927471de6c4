"""Loaders: what builds a context from its template (a causal language model and its
tokenizer). The embedded default model is a template source: :mod:`dask_pcm.templates.embedded`."""
