"""The client side: register contexts, submit work that uses them, read their status."""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING, Any

from dask.base import tokenize
from dask.utils import parse_timedelta
from distributed.protocol.pickle import dumps

from dask_pcm import config
from dask_pcm.context import Context, template_manifest
from dask_pcm.exceptions import ContextLoadError, PCMError
from dask_pcm.protocol import COLUMNS, SETTLE_OP
from dask_pcm.scheduler import registration
from dask_pcm.tasks import ContextTask
from dask_pcm.templates.local import host_stamp
from dask_pcm.templates.sources import EMBEDDED
from dask_pcm.worker import ContextPlugin

if TYPE_CHECKING:
    import pandas as pd
    from distributed import Client, Future

    from dask_pcm.templates.manifest import Manifest

logger = logging.getLogger(__name__)


def register(
    client: Client,
    *contexts: Context,
    level: str | None = None,
    timeout: float | str | None = None,
    reload: bool = False,
    wait: str = "all",
) -> pd.DataFrame:
    """Materialise ``contexts`` on every worker of ``client``'s cluster, now and later.

    Two calls to the scheduler (:mod:`dask_pcm.scheduler.registration`): one declares the
    contexts and registers one :class:`~distributed.WorkerPlugin` per context through the
    scheduler's own ``register_worker_plugin`` (it installs dask_pcm's scheduler plugin
    first where no preload did), so that workers that join later build the context when
    they join; the other answers when the context is ready (or failed) on every worker
    present, from the state reports the scheduler receives.

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
        template, level and template files, by :func:`dask.base.tokenize`) keeps the
        resident copies, so a notebook can call ``register`` again without reloading the
        model. ``reload=True`` rebuilds it on every worker.
    wait : {"all", "first"}
        ``"all"``: return when every present worker has each context ready or failed.
        ``"first"``: as soon as each context is ready on one worker (work can start there:
        tasks go only to workers where their contexts are ready, the others join as they
        finish loading); a worker that fails later is logged there and gets no tasks.

    Returns
    -------
    pandas.DataFrame
        :func:`status` of the registered contexts. With no worker connected it has no
        rows; workers that join later build the contexts.

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
    if wait not in ("all", "first"):
        raise ValueError(f"wait must be 'all' or 'first', not {wait!r}")
    names = [c.name for c in contexts]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate context names in register(): {names}")
    for ctx in contexts:
        if not isinstance(ctx, Context):
            raise TypeError(f"register() takes Context objects, got {ctx!r}")
    declarations = [_declaration(ctx, level) for ctx in contexts]
    installed = client.run_on_scheduler(registration.declare, declarations, reload)
    for d in declarations:
        if installed[d["name"]]:
            logger.info("Registered context %r at level %s", d["name"], d["level"])
        else:
            logger.info("Context %r already registered; reusing it", d["name"])
    wait_s = config.ready_timeout() if timeout is None else _seconds(timeout)
    settle = getattr(client.scheduler, SETTLE_OP)  # the scheduler plugin's handler
    answer = client.sync(settle, names=names, timeout=wait_s, first=wait == "first")
    if answer["left"]:
        # Preempted or scancel'd while loading: no failure of the context. Workers that
        # join later build it themselves.
        logger.warning(
            "Worker(s) %s left while context(s) %s loaded; going on without them",
            ", ".join(answer["left"]),
            ", ".join(names),
        )
    if answer["failures"]:
        raise _load_error(answer)
    return _table(answer["rows"])


def install_scheduler_plugin(client: Client) -> None:
    """Install dask_pcm's scheduler plugin on ``client``'s scheduler where no preload or
    earlier :func:`register` did, without declaring a context: what a run of a function
    that needs no context still relies on (a task that kills its worker errs at the first
    death, :data:`~dask_pcm.protocol.LOSSES_ANNOTATION`)."""
    client.run_on_scheduler(registration.declare, [], False)


def _declaration(ctx: Context, level: str | None) -> dict[str, Any]:
    """What :func:`dask_pcm.scheduler.registration.declare` needs of one context."""
    chosen = context_level(ctx, level)
    copied = copy_manifest(ctx, chosen)
    manifest = None if copied is None else copied.to_json()
    registration_id = uuid.uuid4().hex
    stamp = None if copied is None else host_stamp(copied.digest)
    plugin = ContextPlugin(ctx, chosen, manifest, registration_id, host_stamp=stamp)
    return {
        "name": ctx.name,
        "level": chosen,
        # Dask's own identity of the declaration: equal contexts need no reload.
        "token": tokenize(ctx, chosen, manifest),
        "registration": registration_id,
        "plugin": dumps(plugin),
    }


def _load_error(answer: dict[str, Any]) -> ContextLoadError:
    """The error of a settle answer with failures: one paragraph per context."""
    lines = []
    waited = len(answer["workers"])
    for name, by_worker in answer["failures"].items():
        lines.append(
            f"context {name!r} failed on {len(by_worker)} of {waited} worker(s)"
            + (" and was unregistered:" if name in answer["unregistered"] else ":")
        )
        lines.extend(f"  {w}: {msg}" for w, msg in sorted(by_worker.items()))
    merged = {w: m for by_worker in answer["failures"].values() for w, m in by_worker.items()}
    return ContextLoadError("\n".join(lines), merged)


def context_level(ctx: Context, level: str | None) -> str:
    """The level ``ctx`` is registered at: its own, else ``level``, else the default."""
    return config.check_level(ctx.level or level or config.default_level())


def copy_manifest(ctx: Context, level: str) -> Manifest | None:
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
        manifest = template_manifest(ctx)  # the one a batch run's provenance records
    except PCMError as exc:
        logger.info("No peer-to-peer template for %r: %s", ctx.name, exc)
        return None
    return manifest


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
    client.run_on_scheduler(registration.unregister, list(names))


def registered_contexts(client: Client) -> list[str]:
    """Names of the contexts registered with the scheduler (for present and future workers)."""
    return client.run_on_scheduler(registration.registered)


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
    wanted = None if contexts is None else list(contexts)
    return _table(client.run_on_scheduler(registration.status_rows, wanted))


def _table(rows: list[dict[str, Any]]) -> pd.DataFrame:
    from dask_pcm.status_table import StatusTable  # pandas, only when a table is asked for

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
