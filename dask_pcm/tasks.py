"""The task side: how task code reaches the context on the worker it runs on.

Task code is the same at every level: it calls :func:`get_context`. A task submitted with
:func:`dask_pcm.submit`, :func:`dask_pcm.map` or wrapped by :func:`uses_context` is run by a
:class:`ContextTask`, which waits until the worker's context is ready, builds a per-task
context at levels ``partial`` and ``agnostic``, counts the task, and drops what it built
when the task ends. The hot path at level ``full`` is two dict look-ups and a counter.
"""

from __future__ import annotations

import functools
import pickle
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeGuard

import cloudpickle
from dask.base import tokenize
from dask.utils import funcname
from distributed import get_worker

from dask_pcm.exceptions import ContextNotFoundError
from dask_pcm.protocol import PLUGIN_PREFIX, ContextSource, plugin_name

# Contexts acquired by the ContextTask running in this thread: {name: object}.
_scope = threading.local()


def _plugin(name: str) -> ContextSource:
    try:
        worker = get_worker()
    except ValueError:
        raise ContextNotFoundError(
            f"get_context({name!r}) called outside a Dask worker: contexts live on workers; "
            "submit the function with dask_pcm.submit / dask_pcm.map"
        ) from None
    plugin = worker.plugins.get(plugin_name(name))
    if not _set_up(plugin):
        known = sorted(
            key[len(PLUGIN_PREFIX) :]
            for key, other in list(worker.plugins.items())
            if key.startswith(PLUGIN_PREFIX) and _set_up(other)
        )
        raise ContextNotFoundError(
            f"context {name!r} is not registered on worker {worker.address} "
            f"(registered: {known or 'none'}); call dask_pcm.register(client, context) first"
        )
    return plugin


def _set_up(plugin: object) -> TypeGuard[ContextSource]:
    """Whether ``plugin`` is a context plugin set up on this worker: its ``state`` only
    exists from ``setup`` on (``hasattr`` runs the property; ``isinstance`` against a
    protocol does not, from Python 3.12)."""
    return isinstance(plugin, ContextSource) and hasattr(plugin, "state")


def get_context(name: str) -> Any:
    """Return the ready context ``name`` inside a task.

    Within a task run through :func:`dask_pcm.submit`, :func:`dask_pcm.map` or
    :func:`uses_context`, this returns the object the task was given: the resident one
    at level ``full``, one built for this task at ``partial`` and ``agnostic``. Called from
    any other task it returns the resident object at level ``full`` and builds a new one
    per call at the other levels.

    Raises
    ------
    ContextNotFoundError
        The context is not registered on this worker.
    ContextLoadError
        The context failed to build on this worker.
    ContextTimeoutError
        It did not become ready within ``pcm.worker.ready-timeout``.

    Examples
    --------
    >>> def classify(prompts):                       # doctest: +SKIP
    ...     lm = dask_pcm.get_context("smollm2")
    ...     return lm.next_token_logits(prompts).argmax(-1).tolist()
    >>> dask_pcm.submit(client, classify, ["Is water wet?"], context="smollm2")  # doctest: +SKIP
    """
    held = getattr(_scope, "contexts", None)
    if held is not None and name in held:
        return held[name]
    value, _ = _plugin(name).acquire()
    return value


@contextmanager
def _acquired(names: Sequence[str]) -> Iterator[None]:
    held: dict[str, Any] = getattr(_scope, "contexts", None) or {}
    outer = dict(held)
    taken: list[tuple[ContextSource, Any, bool]] = []
    try:
        for name in names:
            plugin = _plugin(name)
            value, owned = plugin.acquire()
            taken.append((plugin, value, owned))
            held[name] = value
        _scope.contexts = held
        yield
    finally:
        _scope.contexts = outer or None
        for plugin, value, owned in taken:
            plugin.done(value, owned)


class ContextTask:
    """A callable that runs ``fn`` with contexts ``names`` acquired on the worker.

    Built by :func:`uses_context`, :func:`dask_pcm.submit` and :func:`dask_pcm.map`; it
    pickles as the wrapped function plus the names. The scheduler plugin recognises tasks
    whose function is a ``ContextTask`` and restricts them to workers where every one of
    ``names`` is ready; with ``allow_other_workers=True`` they may run on any worker when
    none is ready (that worker then waits for, or rebuilds, the context).
    """

    __slots__ = ("__name__", "_payload", "allow_other_workers", "fn", "names")
    fn: Callable[..., Any]
    names: tuple[str, ...]
    allow_other_workers: bool

    def __init__(
        self,
        fn: Callable[..., Any],
        names: str | Sequence[str],
        allow_other_workers: bool = False,
    ) -> None:
        if not callable(fn):
            raise TypeError(f"expected a callable, got {fn!r}")
        names = (names,) if isinstance(names, str) else tuple(names)
        if isinstance(fn, ContextTask):
            names = tuple(dict.fromkeys(fn.names + names))
            allow_other_workers = allow_other_workers or fn.allow_other_workers
            fn = fn.fn
        if not names:
            raise ValueError("a context task needs at least one context name")
        self.fn = fn
        self.names = names
        self.allow_other_workers = bool(allow_other_workers)
        self._payload: bytes | None = None
        # Keys and the dashboard use the function's name, not "ContextTask".
        self.__name__ = funcname(self.fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with _acquired(self.names):
            return self.fn(*args, **kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        # The scheduler pickles every task it sends, and a function defined in a script or
        # notebook is pickled by value each time: a cost on every task. A ContextTask travels
        # as bytes pickled where it was made: copies unpickled from them (on the scheduler and
        # the workers) keep the bytes and send them on as they are, and a worker unpickles each
        # distinct payload once. The user's own object is pickled afresh at each submission,
        # so a function that reads globals ships their current values, as with plain Dask.
        payload = self._payload
        if payload is None:
            state = (self.fn, self.names, self.allow_other_workers, self.__name__)
            payload = cloudpickle.dumps(state, protocol=5)
        return (_restore, (payload,))

    def __dask_tokenize__(self) -> Any:
        return ("dask_pcm.ContextTask", tokenize(self.fn), self.names, self.allow_other_workers)

    def __repr__(self) -> str:
        extra = ", allow_other_workers=True" if self.allow_other_workers else ""
        return f"ContextTask({self.__name__}, contexts={list(self.names)}{extra})"


@functools.lru_cache(maxsize=256)
def _restore(payload: bytes) -> ContextTask:
    """The ContextTask pickled as ``payload``: one shared object per distinct payload.

    Sharing is safe: a ContextTask keeps no per-call state. Rebuilt without ``__init__``'s
    checks, which ran where it was made.
    """
    task = ContextTask.__new__(ContextTask)
    task.fn, task.names, task.allow_other_workers, task.__name__ = pickle.loads(payload)
    task._payload = payload
    return task


def uses_context(
    *names: str, allow_other_workers: bool = False
) -> Callable[[Callable[..., Any]], ContextTask]:
    """Decorator: the function's tasks run with contexts ``names`` acquired.

    The decorated function can be given to ``client.submit``, ``client.map`` or
    ``dask.delayed`` as it is; its tasks run only on workers where ``names`` are ready
    (see :class:`ContextTask` for ``allow_other_workers``).

    Examples
    --------
    >>> @uses_context("smollm2")
    ... def answer(prompt):
    ...     return get_context("smollm2").complete(prompt)
    >>> answer
    ContextTask(answer, contexts=['smollm2'])
    """

    def wrap(fn: Callable[..., Any]) -> ContextTask:
        return ContextTask(fn, names, allow_other_workers)

    return wrap
