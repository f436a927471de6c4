"""Scheduler preload: what dask_pcm adds to a scheduler from its start.

- On import, dask_pcm's page joins Dask's Bokeh dashboard ("More..." → "Pcm Contexts",
  :mod:`dask_pcm.scheduler.bokeh_page`). It must: the scheduler builds its dashboard before
  it sets up its preloads.
- At start, the scheduler plugin (:class:`~dask_pcm.scheduler.ContextScheduler`) is
  installed, so ``/pcm/status`` answers from the first second (with no context yet) rather
  than from the first :func:`dask_pcm.register`.

:func:`dask_pcm.local_cluster` and :func:`dask_pcm.batch_cluster` give it to their
schedulers; for one started otherwise::

    dask scheduler --preload dask_pcm.scheduler.preload
"""

from __future__ import annotations

from typing import Any

from dask_pcm.scheduler.bokeh_page import add_to_dashboard
from dask_pcm.scheduler.plugin import ContextScheduler

add_to_dashboard()


async def dask_setup(scheduler: Any) -> None:
    await scheduler.register_scheduler_plugin(ContextScheduler(), idempotent=True)
