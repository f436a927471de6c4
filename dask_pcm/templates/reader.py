"""Reading a template's source, through one object per host: plain, or rate-limited."""

from __future__ import annotations

import asyncio
import os
import time

import dask.utils

from dask_pcm import config
from dask_pcm.templates.manifest import Manifest, read_chunk
from dask_pcm.templates.throttle import SharedBandwidth


class SourceReader:
    """Reads a template's chunks from its source (a local folder, or a hub snapshot).

    Every read of a source, by a template copy or a build at level ``agnostic``, goes
    through one of these (:func:`source_reader`), so that a rate limit
    (:class:`ThrottledReader`) can stand in its place.
    """

    def read(self, root: str | os.PathLike[str], manifest: Manifest, index: int) -> bytes:
        """Chunk ``index`` of ``manifest``'s files under ``root``."""
        return read_chunk(root, manifest, index)

    async def aread(self, root: str | os.PathLike[str], manifest: Manifest, index: int) -> bytes:
        """:meth:`read` from the event loop (a template copy): in a thread here; a reader
        that models a link waits for it on the loop instead of holding a thread."""
        return await asyncio.to_thread(self.read, root, manifest, index)

    def account(self, nbytes: int) -> float:
        """A build read ``nbytes`` of the source itself; seconds waited for it (none here)."""
        return 0.0


class ThrottledReader(SourceReader):
    """A :class:`SourceReader` behind a :class:`~dask_pcm.templates.throttle.SharedBandwidth`:
    every chunk read, and every build's read at level ``agnostic``, waits for its share of
    the host's link. What :func:`source_reader` returns when
    ``pcm.template.source-bandwidth`` is set.
    """

    def __init__(self, link: SharedBandwidth, chunk_size: int) -> None:
        self.link = link
        self.chunk_size = chunk_size

    def read(self, root: str | os.PathLike[str], manifest: Manifest, index: int) -> bytes:
        self.link.consume(manifest.chunk(index).length)
        return read_chunk(root, manifest, index)

    async def aread(self, root: str | os.PathLike[str], manifest: Manifest, index: int) -> bytes:
        """:meth:`read` from the event loop: the wait for the link is a sleep on the loop."""
        wait = self.link.book(manifest.chunk(index).length) - time.time()
        if wait > 0:
            await asyncio.sleep(wait)
        return await asyncio.to_thread(read_chunk, root, manifest, index)

    def account(self, nbytes: int) -> float:
        waited = 0.0
        for start in range(0, nbytes, self.chunk_size):
            waited += self.link.consume(min(self.chunk_size, nbytes - start))
        return waited


def source_reader() -> SourceReader:
    """How template sources are read on this host: a plain :class:`SourceReader`, or, when
    ``pcm.template.source-bandwidth`` is set (to protect a shared filesystem, or to model
    one in a benchmark), a :class:`ThrottledReader` sharing
    that many bytes per second among every reader of the host.

    Example
    -------
    >>> with dask.config.set({"pcm.template.source-bandwidth": "200 MB"}):  # doctest: +SKIP
    ...     source_reader()
    <dask_pcm.templates.reader.ThrottledReader object at ...>
    """
    value = config.get("template.source-bandwidth")
    if value is None:
        return SourceReader()
    link = SharedBandwidth(float(dask.utils.parse_bytes(value)), name="template-source")
    chunk = int(dask.utils.parse_bytes(config.get("template.chunk-size")))
    return ThrottledReader(link, chunk)
