"""The three context levels as a table of flags: what a worker prepares, what a task gets.

| level | prepared once per worker | each task gets |
|---|---|---|
| ``full`` | the template copied to local disk, the context built and kept | the resident context |
| ``partial`` | the template copied to local disk | a context built from that copy |
| ``agnostic`` | nothing | a context built from the source (one source read) |

A :class:`Level` only says what its level does; the worker plugin
(:mod:`dask_pcm.worker.plugin`) reads the flags and does it, and :meth:`Level.transitions`
narrows the worker's state machine (:data:`dask_pcm.protocol.WORKER_TRANSITIONS`) to the
level: only a resident context passes through ``loading`` after its copy, and only a
resident context can be ``evicted``.

A context without files (``template=None``) copies nothing at any level: ``partial`` and
``agnostic`` then both build the context for each task from nothing but the loader.
"""

from __future__ import annotations

from dataclasses import dataclass

from dask_pcm.protocol import EVICTED, FETCHING, LOADING, READY, WORKER_TRANSITIONS


@dataclass(frozen=True)
class Level:
    """What one level does (see the module docstring).

    Attributes
    ----------
    name
        ``full``, ``partial`` or ``agnostic``.
    resident
        The context is built once per worker and kept between tasks (and may be evicted
        under ``pcm.worker.context-memory-limit``); else each task builds its own.
    copies
        The template is copied to worker-local disk (from peers, else the source) when the
        client hashed it into a manifest (a local path, the embedded model).
    copies_unhashed
        ... and also when it could not (a hub id): the worker lists and copies it from the
        source, since every task builds from it again.
    reads_source_per_task
        Every task's build reads the template from its source (counted against
        ``pcm.template.source-bandwidth``).
    """

    name: str
    resident: bool
    copies: bool
    copies_unhashed: bool
    reads_source_per_task: bool

    def copies_template(self, has_manifest: bool, has_files: bool) -> bool:
        """Whether a worker copies this context's template before preparing it."""
        return self.copies and (has_manifest or (self.copies_unhashed and has_files))

    def transitions(self) -> dict[str, frozenset[str]]:
        """:data:`~dask_pcm.protocol.WORKER_TRANSITIONS` as they apply at this level."""
        out = dict(WORKER_TRANSITIONS)
        if self.resident:  # built under "loading", once the copy is done
            out[FETCHING] = out[FETCHING] - {READY}
        else:  # ready once prepared; never resident, so never evicted
            out[FETCHING] = out[FETCHING] - {LOADING}
            out[READY] = out[READY] - {EVICTED}
            out[EVICTED] = frozenset()
        return out


LEVELS: dict[str, Level] = {
    level.name: level
    for level in (
        Level(
            "full", resident=True, copies=True, copies_unhashed=False, reads_source_per_task=False
        ),
        Level(
            "partial",
            resident=False,
            copies=True,
            copies_unhashed=True,
            reads_source_per_task=False,
        ),
        Level(
            "agnostic",
            resident=False,
            copies=False,
            copies_unhashed=False,
            reads_source_per_task=True,
        ),
    )
}
"""The levels by name."""

__all__ = ["LEVELS", "Level"]
