"""The batch layer: any task function over any dataset, against contexts resident on the
workers, resumable and keyed by what determines the results.

:func:`run_batch` is the entry point; :class:`BatchResult` what it returns;
:func:`content_digest` (from :mod:`dask_pcm.context`) names a context's files by their
contents: what the output folder's provenance records. Underneath: :mod:`~dask_pcm.batch.units` (units and the task that runs
them), :mod:`~dask_pcm.batch.dispatch` (waves of packed tasks, lost rows isolated, timeouts),
:mod:`~dask_pcm.batch.store` and :mod:`~dask_pcm.batch.segments` (the resumable output
folder), :mod:`~dask_pcm.batch.provenance`. Applications (:mod:`dask_pcm.apps.fever`) stand on it.
"""

from __future__ import annotations

from dask_pcm.batch.run import BatchResult, run_batch
from dask_pcm.context import content_digest

__all__ = ["BatchResult", "content_digest", "run_batch"]
