"""The client side: register contexts, submit work that uses them, read their status."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING, Any

from dask.utils import parse_timedelta
from distributed.protocol.pickle import dumps

from dask_pcm import config
from dask_pcm.context import Context
from dask_pcm.deploy.preemption import GracefulPreemption
from dask_pcm.exceptions import ContextLoadError, ContextNotFoundError, PCMError
from dask_pcm.protocol import COLUMNS
from dask_pcm.scheduler import ContextScheduler, get_plugin
from dask_pcm.tasks import ContextTask
from dask_pcm.templates.manifest import build_manifest
from dask_pcm.templates.sources import EMBEDDED
from dask_pcm.templates.tree import list_template
from dask_pcm.worker import PLUGIN_PREFIX, ContextPlugin, context_plugins, plugin_name

if TYPE_CHECKING:
    import pandas as pd
    from distributed import Client, Future, Worker

logger = logging.getLogger(__name__)


def register(
    client: Client,
    *contexts: Context,
    level: str | None = None,
    timeout: float | str | None = None,
    reload: bool = False,
) -> pd.DataFrame:
    """Materialise ``contexts`` on every worker of ``client``'s cluster, now and later.

    Registers one :class:`~distributed.WorkerPlugin` per context through
    ``Client.register_plugin``; workers that join later build the context when they join.
    Then waits until the context is ready (or failed) on every worker present.

    Parameters
    ----------
    client : distributed.Client
    *contexts : Context
        The contexts to register, e.g. from :func:`dask_pcm.causal_lm`.
    level : {"full", "partial", "agnostic"}, optional
        Level for contexts that do not name one; default ``pcm.default-level``.
    timeout : float or str, optional
        Give up waiting for the present workers after this long (``"10 minutes"``); a
        worker still loading then counts as failed. Default ``pcm.worker.ready-timeout``.
    reload : bool
        Registering a context identical to one already registered (same name, loader,
        template and level) keeps the resident copies, so a notebook can call ``register``
        again without reloading the model. ``reload=True`` rebuilds it on every worker.

    Returns
    -------
    pandas.DataFrame
        :func:`status` of the registered contexts.

    Raises
    ------
    ContextLoadError
        The loader failed on one or more present workers; ``failures`` maps each worker
        address to its message. A context that failed on *every* present worker is
        unregistered again; one that is ready on some workers stays registered there.

    Examples
    --------
    >>> ctx = dask_pcm.causal_lm(name="smollm2")          # doctest: +SKIP
    >>> dask_pcm.register(client, ctx)                     # doctest: +SKIP
    """
    if not contexts:
        raise ValueError("register() needs at least one Context")
    names = [c.name for c in contexts]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate context names in register(): {names}")
    for ctx in contexts:
        if not isinstance(ctx, Context):
            raise TypeError(f"register() takes Context objects, got {ctx!r}")
    # The scheduler plugin first: worker plugins report to it from their first moment.
    client.register_plugin(ContextScheduler())
    # Workers retire gracefully on a batch system's preemption warning (SIGUSR2).
    client.register_plugin(GracefulPreemption())
    for ctx in contexts:
        chosen = config.check_level(ctx.level or level or config.default_level())
        plugin = ContextPlugin(ctx, chosen, _manifest_json(ctx, chosen))
        if not reload and _already_registered(client, plugin):
            logger.info("Context %r already registered; reusing it", ctx.name)
            continue
        client.run_on_scheduler(_declare, ctx.name, chosen)
        client.register_plugin(plugin, name=plugin.name)
        logger.info("Registered context %r at level %s", ctx.name, chosen)

    wait_s = config.ready_timeout() if timeout is None else _seconds(timeout)
    results = client.run(_wait_ready, names, wait_s, on_error="return")
    failures: dict[str, dict[str, str]] = {}
    for worker, per_context in list(results.items()):
        if isinstance(per_context, BaseException):
            # The worker left while loading (preempted, scancel'd): no failure of the
            # context. Workers that join later build it themselves.
            logger.warning(
                "Worker %s left while context(s) %s loaded (%r); going on without it",
                worker,
                ", ".join(names),
                per_context,
            )
            del results[worker]
            continue
        for name, error in per_context.items():
            if error is not None:
                failures.setdefault(name, {})[worker] = error
    if failures:
        lines = []
        for name, by_worker in failures.items():
            everywhere = len(by_worker) == len(results)
            if everywhere:
                unregister(client, name)
            lines.append(
                f"context {name!r} failed on {len(by_worker)} of {len(results)} worker(s)"
                + (" and was unregistered:" if everywhere else ":")
            )
            lines.extend(f"  {w}: {msg}" for w, msg in sorted(by_worker.items()))
        merged = {w: m for by_worker in failures.values() for w, m in by_worker.items()}
        raise ContextLoadError("\n".join(lines), merged)
    # The workers' "ready" reports travel on their own streams: let them land.
    client.run_on_scheduler(_settled, names, list(results), 5.0)
    return status(client, names)


def _manifest_json(ctx: Context, level: str) -> str | None:
    """The template's chunk manifest for peer-to-peer transfer, where it applies.

    Only for levels full and partial and a template that is a local path (any directory
    or file) or ``"embedded"``, listed by the context's loader
    (:func:`dask_pcm.templates.tree.list_template`) and hashed here once (cached; see
    :mod:`dask_pcm.templates.manifest`). Workers then copy it chunk by chunk into local
    disk, from peers unless ``pcm.template.peer-to-peer`` is false, and build the context
    from that copy. Hub ids are read by each worker from the source; a context without
    files (``template=None``) has nothing to copy.
    """
    template = ctx.template
    if level == "agnostic" or template is None:
        return None
    if not (template == EMBEDDED or os.path.exists(template)):
        return None
    try:
        manifest, _ = build_manifest(list_template(template, ctx.loader))
    except PCMError as exc:
        logger.info("No peer-to-peer template for %r: %s", ctx.name, exc)
        return None
    return manifest.to_json()


def _declare(name: str, level: str, dask_scheduler: Any = None) -> None:
    get_plugin(dask_scheduler).declare(name, level)


async def _settled(
    names: list[str], workers: list[str], timeout: float, dask_scheduler: Any = None
) -> None:
    plugin = get_plugin(dask_scheduler)
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        rows = plugin.rows(names)
        if all(r["state"] in ("ready", "failed") for r in rows if r["worker"] in workers):
            return
        await asyncio.sleep(0.02)


async def _wait_ready(
    names: list[str], timeout: float | None, dask_worker: Worker
) -> dict[str, str | None]:
    plugins = context_plugins(dask_worker)
    out: dict[str, str | None] = {}
    for name in names:
        plugin = plugins.get(name)
        if plugin is None:
            out[name] = f"context {name!r} is not registered on this worker"
            continue
        try:
            await asyncio.to_thread(plugin.wait_ready, timeout)
            out[name] = None
        except Exception as exc:
            out[name] = plugin.error or str(exc)
    return out


def _already_registered(client: Client, plugin: ContextPlugin) -> bool:
    def stored(name: str, dask_scheduler: Any = None) -> bytes | None:
        return dask_scheduler.worker_plugins.get(name)

    return client.run_on_scheduler(stored, plugin.name) == dumps(plugin)


def _seconds(value: float | str) -> float:
    return float(parse_timedelta(value, default="s"))


def unregister(client: Client, *names: str) -> None:
    """Remove contexts from every worker and free them (device memory included).

    Raises
    ------
    ContextNotFoundError
        A name is not registered.

    Examples
    --------
    >>> dask_pcm.unregister(client, "smollm2")             # doctest: +SKIP
    """
    registered = registered_contexts(client)
    missing = [n for n in names if n not in registered]
    if missing:
        raise ContextNotFoundError(
            f"not registered: {missing}; registered contexts: {sorted(registered) or 'none'}"
        )
    for name in names:
        client.unregister_worker_plugin(plugin_name(name))
        client.run_on_scheduler(_forget, name)


def _forget(name: str, dask_scheduler: Any = None) -> None:
    get_plugin(dask_scheduler).forget(name)


def registered_contexts(client: Client) -> list[str]:
    """Names of the contexts registered with the scheduler (for present and future workers)."""

    def names(dask_scheduler: Any) -> list[str]:
        return [n for n in dask_scheduler.worker_plugins if n.startswith(PLUGIN_PREFIX)]

    return sorted(n[len(PLUGIN_PREFIX) :] for n in client.run_on_scheduler(names))


def _status_rows(contexts: list[str] | None, dask_scheduler: Any = None) -> list[dict[str, Any]]:
    plugin = dask_scheduler.plugins.get(ContextScheduler.name)
    return [] if plugin is None else plugin.rows(contexts)


def status(client: Client, contexts: Iterable[str] | None = None) -> pd.DataFrame:
    """One row per worker and context, as the scheduler plugin tracks them.

    The columns are the fields of :class:`dask_pcm.protocol.ContextStatus`, in order (its
    docstring says what each holds): ``worker, context, state, level, state_seconds,
    loads, ...``. ``state`` is ``absent`` (no report yet), ``fetching`` (copying the
    template), ``loading``, ``ready``, ``failed`` (``error`` says why) or ``evicted`` (freed
    under ``pcm.worker.context-memory-limit``; rebuilt on demand). The same rows are served
    as JSON at ``/pcm/status.json`` on the dashboard's port. In Jupyter the table shows its
    states coloured as on the ``/pcm/status`` page (:class:`dask_pcm.status_table.StatusTable`,
    a DataFrame).

    Examples
    --------
    >>> dask_pcm.status(client)[["worker", "context", "state", "loads", "tasks"]]  # doctest: +SKIP
    """
    from dask_pcm.status_table import StatusTable  # pandas, only when a table is asked for

    wanted = None if contexts is None else list(contexts)
    rows = client.run_on_scheduler(_status_rows, wanted)
    return StatusTable(rows, columns=list(COLUMNS))


def status_page(client: Client) -> str | None:
    """Address of the contexts page (``/pcm/status``) beside ``client``'s Dask dashboard;
    ``None`` when the scheduler serves no dashboard.

    Examples
    --------
    >>> dask_pcm.status_page(client)  # doctest: +SKIP
    'http://127.0.0.1:8787/pcm/status'
    """
    link = client.dashboard_link
    if not link:
        return None
    return link.rsplit("/", 1)[0] + "/pcm/status"


def submit(
    client: Client,
    fn: Any,
    *args: Any,
    context: str | list[str],
    allow_other_workers: bool = False,
    **kwargs: Any,
) -> Future:
    """``client.submit`` for a function that uses ``context`` through ``get_context``.

    The task runs only on a worker where ``context`` is ready (see
    :mod:`dask_pcm.scheduler`); with ``allow_other_workers=True`` it may run on any worker
    when none is, and that worker waits for or rebuilds the context. Other keyword arguments
    are those of :meth:`distributed.Client.submit` (``key``, ``pure``, ``retries``,
    ``priority``...); the rest go to ``fn``, exactly as with ``Client.submit``.

    Examples
    --------
    >>> def answer(prompt):
    ...     return dask_pcm.get_context("smollm2").complete(prompt)
    >>> fut = dask_pcm.submit(client, answer, "Hello", context="smollm2")  # doctest: +SKIP
    """
    return client.submit(ContextTask(fn, context, allow_other_workers), *args, **kwargs)


def map(  # mirrors Client.map, hence the name
    client: Client,
    fn: Any,
    *iterables: Collection[Any],
    context: str | list[str],
    allow_other_workers: bool = False,
    **kwargs: Any,
) -> list[Future]:
    """``client.map`` for a function that uses ``context`` through ``get_context``.

    Placement as in :func:`submit`.

    Examples
    --------
    >>> futs = dask_pcm.map(client, answer, prompts, context="smollm2")  # doctest: +SKIP
    >>> client.gather(futs)                                             # doctest: +SKIP
    """
    return client.map(ContextTask(fn, context, allow_other_workers), *iterables, **kwargs)
