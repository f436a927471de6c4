"""What :func:`dask_pcm.register` asks of the scheduler: two calls.

1. :func:`declare`, run on the scheduler (``Client.run_on_scheduler``): it installs the
   scheduler plugin where no preload did, declares each context and registers its worker
   plugin through the scheduler's own ``register_worker_plugin``, so that present workers
   set it up now and joining ones when they join. A context declared before under the same
   *token* (:func:`dask.base.tokenize` of its name, loader, template, level and template
   manifest, made by the client) is left as it is: nothing goes to the workers, nothing
   reloads. A new declaration replaces the old plugin by name, as distributed does.
2. The ``pcm_settle`` handler (:meth:`dask_pcm.scheduler.readiness.Readiness.settle`): it
   answers when the contexts are ready or failed on every worker present, without polling.

Each declaration carries a fresh *registration* id that its worker plugin tags its reports
with, so that a late report of the plugin it replaced (``ready``, say, of the copy being
freed) is not taken for one of the new plugin.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from dask_pcm.exceptions import ContextNotFoundError
from dask_pcm.protocol import FAILED, PLUGIN_PREFIX, plugin_name
from dask_pcm.scheduler.plugin import PLUGIN_NAME, ContextScheduler, get_plugin

if TYPE_CHECKING:
    from distributed import Scheduler

# A failure the scheduler records itself (the plugin never started on that worker): no
# report of that plugin will come to overtake it.
_FINAL_SEQ = sys.maxsize


async def declare(
    declarations: list[dict[str, Any]], reload: bool, dask_scheduler: Scheduler
) -> dict[str, bool]:
    """Declare contexts and install their worker plugins (see the module docstring).

    Parameters
    ----------
    declarations
        One mapping per context: ``name``, ``level``, ``token``, ``registration`` (a fresh
        id) and ``plugin`` (the pickled :class:`~dask_pcm.worker.ContextPlugin`).
    reload
        Replace contexts whose token is unchanged too.

    Returns
    -------
    dict
        Context name -> whether its plugin was (re)registered (``False``: kept as it was).
    """
    if PLUGIN_NAME not in dask_scheduler.plugins:  # no preload installed it
        await dask_scheduler.register_scheduler_plugin(ContextScheduler(), idempotent=True)
    plugin = get_plugin(dask_scheduler)
    done: dict[str, bool] = {}
    for declaration in declarations:
        name = declaration["name"]
        installed = plugin_name(name) in dask_scheduler.worker_plugins
        if installed and not reload and plugin.readiness.token(name) == declaration["token"]:
            done[name] = False
            continue
        registration = declaration["registration"]
        # Declared first: the new plugin's reports may arrive before the broadcast returns.
        plugin.declare(name, declaration["level"], declaration["token"], registration)
        responses = await dask_scheduler.register_worker_plugin(
            None, plugin=declaration["plugin"], name=plugin_name(name), idempotent=False
        )
        for worker, response in responses.items():
            if isinstance(response, dict) and response.get("status") == "error":
                error = response.get("exception_text") or "the worker plugin failed to start"
                plugin.on_state(
                    worker, name, FAILED, _FINAL_SEQ, error=error, registration=registration
                )
        done[name] = True
    return done


def registered(dask_scheduler: Scheduler) -> list[str]:
    """Names of the contexts whose worker plugins the scheduler holds, sorted."""
    plugins = dask_scheduler.worker_plugins
    return sorted(n[len(PLUGIN_PREFIX) :] for n in plugins if n.startswith(PLUGIN_PREFIX))


async def unregister(names: list[str], dask_scheduler: Scheduler) -> None:
    """Unregister contexts from the scheduler and every worker.

    Raises
    ------
    ContextNotFoundError
        A name is not registered (the message lists those that are).
    """
    known = registered(dask_scheduler)
    missing = [n for n in names if n not in known]
    if missing:
        raise ContextNotFoundError(
            f"not registered: {missing}; registered contexts: {known or 'none'}"
        )
    plugin = get_plugin(dask_scheduler)
    for name in names:
        await plugin.unregister(name)


def status_rows(contexts: list[str] | None, dask_scheduler: Scheduler) -> list[dict[str, Any]]:
    """Status rows of ``contexts`` (all: ``None``); none before the scheduler plugin is
    installed."""
    plugin = dask_scheduler.plugins.get(PLUGIN_NAME)
    return plugin.rows(contexts) if isinstance(plugin, ContextScheduler) else []


__all__ = ["declare", "registered", "status_rows", "unregister"]
