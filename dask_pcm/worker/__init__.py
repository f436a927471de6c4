"""The worker side of dask_pcm: the plugin that materialises a context on every worker,
the context's state machine (:mod:`.lifecycle`), the levels as a table of flags, the
template on local disk, the memory budget (see :mod:`.plugin`)."""

from __future__ import annotations

from dask_pcm.worker.plugin import PLUGIN_PREFIX, ContextPlugin, context_plugins, plugin_name

__all__ = ["PLUGIN_PREFIX", "ContextPlugin", "context_plugins", "plugin_name"]
