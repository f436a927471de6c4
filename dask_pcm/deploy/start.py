"""What ``dask_pcm`` exports to start batch-system clusters, without importing dask-jobqueue.

:func:`batch_cluster` imports :mod:`dask_pcm.deploy.batch` (and with it dask-jobqueue, whose
``runner`` module replaces the process's SIGINT handler when imported) only when called.
"""

from __future__ import annotations

from typing import Any


def batch_cluster(kind: str = "sge", **kwargs: Any) -> Any:
    """Start a batch-system cluster: :func:`dask_pcm.deploy.batch.batch_cluster`, which
    this imports (with dask-jobqueue) only when called.

    Examples
    --------
    >>> cluster = dask_pcm.batch_cluster("sge", minimum=1, maximum=8)   # doctest: +SKIP
    """
    from dask_pcm.deploy import batch

    return batch.batch_cluster(kind, **kwargs)
