"""Applications on the batch layer: each one is a task function, its inputs and outputs,
and one :func:`dask_pcm.run_batch` call; the layers below know nothing of them.

- :mod:`~dask_pcm.apps.llm`: the built-in LLM tasks (generation, choice scoring,
  embeddings) on a :class:`dask_pcm.LanguageModel` context;
- :mod:`~dask_pcm.apps.fever`: the FEVER fact-checking prompt search (:func:`dask_pcm.run_fever`);
- :mod:`~dask_pcm.apps.openai_batch`: OpenAI Batch API files answered on a cluster
  (``dask-pcm batch``).
"""
