"""The scheduler side of dask_pcm: context states, task placement, the chunk directory,
the adaptive keep rule, the status page and metrics (see :mod:`.plugin`)."""

from __future__ import annotations

from dask_pcm.scheduler.plugin import PLUGIN_NAME, ContextScheduler, get_plugin

__all__ = ["PLUGIN_NAME", "ContextScheduler", "get_plugin"]
